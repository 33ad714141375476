"""POST /evaluate and POST /evaluate/batch: score traces."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.exceptions import RequestValidationError

from app.api.deps import Services, ServicesDep
from app.api.presenters import evaluation_out
from app.schemas.responses import BatchIn, BatchOut, EvaluationOut
from app.schemas.trace import ReasoningTrace
from app.services.evaluator import Evaluation
from app.services.scoring_requests import TraceLimitError, score_traces

router = APIRouter(
    tags=["evaluate"],
    responses={
        400: {"description": "A body that cannot be read as JSON text (not UTF-8)."},
        413: {"description": "Body larger than KP_MAX_BODY_BYTES."},
        415: {"description": "Content-Type is not application/json."},
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


@router.post("/evaluate", summary="Score one reasoning trace", responses=_NEXT)
async def evaluate(
    trace: ReasoningTrace, services: ServicesDep, dry_run: DryRun = False
) -> EvaluationOut:
    (evaluation,) = await _score(services, [trace], dry_run=dry_run, batch=False)
    return evaluation_out(evaluation)


@router.post("/evaluate/batch", summary="Score traces in order, as one step", responses=_NEXT)
async def evaluate_batch(
    batch: BatchIn, services: ServicesDep, dry_run: DryRun = False
) -> BatchOut:
    evaluations = await _score(services, batch.traces, dry_run=dry_run, batch=True)
    return BatchOut(results=[evaluation_out(e) for e in evaluations])


async def _score(
    services: Services, traces: list[ReasoningTrace], *, dry_run: bool, batch: bool
) -> list[Evaluation]:
    try:
        return await score_traces(
            services.evaluator,
            services.limits,
            services.metrics,
            traces,
            dry_run=dry_run,
            batch=batch,
            transport="rest",
        )
    except TraceLimitError as exc:
        raise RequestValidationError(exc.errors) from None
