"""POST /evaluate and POST /evaluate/batch: score traces."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Header, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError

from app.api import request_examples
from app.api.asgi.namespaces import namespace_of
from app.api.batch_cost import charge_batch
from app.api.deps import BEARER_SECURITY, NamespaceHeader, Services, services_of
from app.api.presenters import evaluation_out
from app.core.signatures import unsignable_errors
from app.schemas.responses import BatchIn, BatchOut, EvaluationOut
from app.schemas.trace import ReasoningTrace
from app.service.evaluator import Evaluation
from app.service.scoring_requests import TraceLimitError, score_traces

# The hot path: no FastAPI dependency beyond the parameters (each costs a resolution per
# request); the bearer scheme is declared for the document only (app/api/deps.py).
router = APIRouter(
    tags=["evaluate"],
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

DryRun = Annotated[
    bool, Query(description="Score without adding the trace's embedding to the cache.")
]
IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        # Checked before the route, with its rule stated in the document (openapi_doc.py).
        description="The same key with the same request within 24 h gets the first answer "
        "again, byte for byte (header Idempotent-Replayed: true), and adds nothing; with "
        "another request, 422. Scoped to the API key and the namespace. Handled before the route "
        "(app/api/asgi/idempotency.py).",
    ),
]


@router.post(
    "/evaluate",
    summary="Score one reasoning trace",
    responses=_NEXT,
    openapi_extra=BEARER_SECURITY,
)
async def evaluate(
    trace: Annotated[ReasoningTrace, Body(openapi_examples=request_examples.EVALUATE)],
    request: Request,
    dry_run: DryRun = False,
    idempotency_key: IdempotencyKey = None,
    kp_namespace: NamespaceHeader = None,
) -> EvaluationOut:
    services = services_of(request)
    sent = await _sent_traces(services, request, batch=False)
    (evaluation,) = await _score(services, request, [trace], dry_run=dry_run, batch=False)
    return _answer(services, evaluation, sent, 0, dry_run=dry_run)


@router.post(
    "/evaluate/batch",
    summary="Score traces in order, as one step",
    responses=_NEXT,
    openapi_extra=BEARER_SECURITY,
)
async def evaluate_batch(
    batch: Annotated[BatchIn, Body(openapi_examples=request_examples.BATCH)],
    request: Request,
    dry_run: DryRun = False,
    idempotency_key: IdempotencyKey = None,
    kp_namespace: NamespaceHeader = None,
) -> BatchOut:
    services = services_of(request)
    key = getattr(request.state, "api_key", None)
    refused = await charge_batch(services.rate_limiter, key, len(batch.traces), ("body",))
    if refused is not None:
        headers = (
            None if refused.retry_after_s is None else {"Retry-After": str(refused.retry_after_s)}
        )
        raise HTTPException(refused.status, [refused.error], headers)
    sent = await _sent_traces(services, request, batch=True)
    evaluations = await _score(services, request, batch.traces, dry_run=dry_run, batch=True)
    return BatchOut(
        results=[_answer(services, e, sent, i, dry_run=dry_run) for i, e in enumerate(evaluations)]
    )


async def _sent_traces(services: Services, request: Request, *, batch: bool) -> list[Any] | None:
    """With signing on: the traces as the agent sent them (their hash is signed), parsed as
    FastAPI parsed them; a trace RFC 8785 cannot make canonical is a 422, before scoring."""
    if services.signer is None:
        return None
    # FastAPI parsed the body with request.json(), which keeps the result: no second parse.
    body = await request.json()
    traces: list[Any] = body["traces"] if batch else [body]
    errors = unsignable_errors(traces, batch=batch, at=("body",))
    if errors:
        raise RequestValidationError(errors)
    return traces


def _answer(
    services: Services,
    evaluation: Evaluation,
    sent: list[Any] | None,
    index: int,
    *,
    dry_run: bool,
) -> EvaluationOut:
    if sent is None:
        return evaluation_out(evaluation)
    return evaluation_out(evaluation, services.signer, sent[index], dry_run=dry_run)


async def _score(
    services: Services,
    request: Request,
    traces: list[ReasoningTrace],
    *,
    dry_run: bool,
    batch: bool,
) -> list[Evaluation]:
    # The body was read to parse it: this is its size, not a second read.
    body_bytes = len(await request.body())
    try:
        return await score_traces(
            services.evaluator,
            services.limits,
            services.metrics,
            traces,
            dry_run=dry_run,
            batch=batch,
            transport="rest",
            namespace=namespace_of(request.scope),
            body_bytes=body_bytes,
        )
    except TraceLimitError as exc:
        raise RequestValidationError(exc.errors) from None
