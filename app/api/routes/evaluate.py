"""POST /evaluate and POST /evaluate/batch: score traces."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.exceptions import RequestValidationError

from app.api.deps import Services, ServicesDep
from app.api.presenters import evaluation_out
from app.schemas.limits import limit_errors
from app.schemas.responses import BatchIn, BatchOut, EvaluationOut
from app.schemas.trace import ReasoningTrace
from app.services.evaluator import Evaluation

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
    _check_limits(services, [trace], batch=False)
    (evaluation,) = await services.evaluator.evaluate([trace], dry_run=dry_run)
    _count(services, [evaluation])
    return evaluation_out(evaluation)


@router.post("/evaluate/batch", summary="Score traces in order, as one step", responses=_NEXT)
async def evaluate_batch(
    batch: BatchIn, services: ServicesDep, dry_run: DryRun = False
) -> BatchOut:
    _check_limits(services, batch.traces, batch=True)
    evaluations = await services.evaluator.evaluate(batch.traces, dry_run=dry_run)
    _count(services, evaluations)
    return BatchOut(results=[evaluation_out(e) for e in evaluations])


def _check_limits(services: Services, traces: list[ReasoningTrace], *, batch: bool) -> None:
    errors = limit_errors(traces, services.limits, batch=batch)
    if errors:
        raise RequestValidationError(errors)


def _count(services: Services, evaluations: list[Evaluation]) -> None:
    m = services.metrics
    for e in evaluations:
        m.evaluations.labels(e.score.weights.name).inc()
        m.score.observe(e.score.value)
        for rule in e.score.overrides:
            m.overrides.labels(rule).inc()
        if not e.novelty.measured and e.novelty.reason is not None:
            m.novelty_unmeasured.labels(e.novelty.reason).inc()
