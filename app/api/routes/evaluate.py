"""POST /evaluate, POST /evaluate/batch and POST /contribution: a trace (or traces) in, the
service's answer out. FastAPI validates the body against the schema; the service does the
rest (app/service/scoring_service.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Request
from fastapi.responses import Response

from app.api import request_examples
from app.api.deps import BEARER_SECURITY, DryRun, IdempotencyKey, NamespaceHeader
from app.schemas.contribution import (
    REDACT_SUSPECTED,
    REJECT_THRESHOLD,
    SUSPICIOUS_THRESHOLD,
    ContributionOptions,
    ContributionOut,
)
from app.schemas.responses import BatchIn, BatchOut, EvaluationOut
from app.schemas.trace import ReasoningTrace
from app.service.scoring_service import Kind, Replay, Scoring, ScoringService

router = APIRouter(
    responses={
        400: {
            "description": "A body that cannot be read as JSON text (not UTF-8), a malformed "
            "Idempotency-Key, an API key in the query string, or two KP-Namespace headers."
        },
        401: {"description": "KP_API_KEYS_FILE is set and the bearer key is missing or unknown."},
        403: {
            "description": "The key lacks the scope evaluate, or is bound to another namespace "
            "than KP-Namespace names (namespace_forbidden)."
        },
        409: {
            "description": "A request with this Idempotency-Key is still being answered after "
            "a wait: retry after Retry-After; or the trace would start a namespace past "
            "KP_MAX_NAMESPACES (namespace_limit): nothing was scored."
        },
        429: {
            "description": "The key is over its rate_per_minute (a batch costs one token per "
            "trace): nothing was scored, retry after Retry-After."
        },
        413: {"description": "Body larger than KP_MAX_BODY_BYTES."},
        415: {"description": "Content-Type is not application/json."},
        422: {
            "description": "Invalid trace, an Idempotency-Key already used for another request, "
            "a batch of more traces than the key's rate_per_minute, or a KP-Namespace that "
            "breaks the name's rule (namespace_invalid)."
        },
        503: {
            "description": "Overloaded: too many texts wait for the model (KP_EMBED_QUEUE_LIMIT) "
            "or this one waited too long (KP_EMBED_MAX_WAIT_MS); nothing changed, retry after "
            "Retry-After."
        },
    },
)

# OpenAPI links: what an operator or agent may call next (schemathesis walks them statefully).
_NEXT: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The score and its breakdown.",
        "links": {
            "CacheStats": {"operationId": "cache_stats_cache_get"},
            "CacheReset": {"operationId": "cache_clear_cache_delete"},
        },
    }
}
_SURROGATE: dict[int | str, dict[str, Any]] = {
    422: {
        "description": str(router.responses[422]["description"])
        + " Also a string (or key) holding a lone surrogate: UTF-8 cannot carry it."
    }
}


async def _answer(
    request: Request,
    kind: Kind,
    traces: Sequence[ReasoningTrace],
    dry_run: bool,
    idempotency_key: str | None,
    options: ContributionOptions | None = None,
) -> Response:
    body = await request.body()
    sent = await request.json()  # FastAPI parsed the body with it, which keeps the result
    replay = None
    if idempotency_key is not None:
        query = request.scope.get("query_string", b"")
        replay = Replay(idempotency_key, request.method, request.url.path, query, body)
    scoring = Scoring(
        request.scope["state"]["caller"],  # Admission's, on every scoring route
        kind,
        traces,
        sent["traces"] if kind == "batch" else [sent],
        dry_run=dry_run,
        body_bytes=len(body),
        replay=replay,
        options=options,
    )
    service: ScoringService = request.app.state.service
    answer = await service.score(scoring)
    headers = {"Idempotent-Replayed": "true"} if answer.replayed else None
    return Response(answer.body, answer.status, headers, media_type="application/json")


@router.post(
    "/evaluate",
    tags=["evaluate"],
    summary="Score one reasoning trace",
    response_model=EvaluationOut,
    responses=_NEXT,
    openapi_extra=BEARER_SECURITY,
)
async def evaluate(
    trace: Annotated[ReasoningTrace, Body(openapi_examples=request_examples.EVALUATE)],
    request: Request,
    dry_run: DryRun = False,
    idempotency_key: IdempotencyKey = None,
    kp_namespace: NamespaceHeader = None,
) -> Response:
    return await _answer(request, "one", [trace], dry_run, idempotency_key)


@router.post(
    "/evaluate/batch",
    tags=["evaluate"],
    summary="Score traces in order, as one step",
    response_model=BatchOut,
    responses=_NEXT,
    openapi_extra=BEARER_SECURITY,
)
async def evaluate_batch(
    batch: Annotated[BatchIn, Body(openapi_examples=request_examples.BATCH)],
    request: Request,
    dry_run: DryRun = False,
    idempotency_key: IdempotencyKey = None,
    kp_namespace: NamespaceHeader = None,
) -> Response:
    return await _answer(request, "batch", batch.traces, dry_run, idempotency_key)


@router.post(
    "/contribution",
    tags=["contribution"],
    summary="Score a trace and show what contributing it would send",
    response_model=ContributionOut,
    responses={
        200: {"description": "The score, and the trace as the SDK would contribute it."},
        **_SURROGATE,
    },
    openapi_extra=BEARER_SECURITY,
)
async def contribution(
    trace: ReasoningTrace,
    request: Request,
    dry_run: DryRun = False,
    redact_suspected: Annotated[bool | None, Query(description=REDACT_SUSPECTED)] = None,
    suspicious_threshold: Annotated[
        float | None, Query(ge=0, le=1, description=SUSPICIOUS_THRESHOLD)
    ] = None,
    reject_threshold: Annotated[
        float | None, Query(ge=0, le=1, description=REJECT_THRESHOLD)
    ] = None,
    idempotency_key: IdempotencyKey = None,
    kp_namespace: NamespaceHeader = None,
) -> Response:
    options = ContributionOptions(
        redact_suspected=redact_suspected,
        suspicious_threshold=suspicious_threshold,
        reject_threshold=reject_threshold,
    )
    return await _answer(request, "contribution", [trace], dry_run, idempotency_key, options)
