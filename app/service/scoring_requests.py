"""One scoring request, whichever way it came in (REST or MCP): the size limits, the
evaluation, and what the metrics count of it. Routes and MCP tools translate the errors into
their own shapes (a 422 or a tool error) and the evaluations into their answers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from app.core.metrics import Metrics
from app.embedding.embeddings import OverloadedError
from app.schemas.limits import TraceLimits, limit_errors
from app.schemas.trace import ReasoningTrace
from app.service.evaluator import Evaluation, Evaluator

Transport = Literal["rest", "mcp"]


class TraceLimitError(Exception):
    """Traces over KP_MAX_BATCH, KP_MAX_STEPS or KP_MAX_STRING_CHARS: errors in FastAPI's
    shape, each naming a field by its path (from "body", as a request body's fields)."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__(f"{len(errors)} limit(s) exceeded")
        self.errors = errors


async def score_traces(
    evaluator: Evaluator,
    limits: TraceLimits,
    metrics: Metrics,
    traces: Sequence[ReasoningTrace],
    *,
    dry_run: bool,
    batch: bool,
    transport: Transport,
    namespace: str,
    body_bytes: int | None = None,
) -> list[Evaluation]:
    """Score traces in order (one trace, or a batch as one step) in the namespace's memory;
    raises TraceLimitError, the embedding service's OverloadedError (counted) or the memory's
    NamespaceLimitError, in each case having changed nothing. `body_bytes`:
    the request body's size when known (it spares the limits a walk)."""
    m = metrics
    m.child(m.scoring_requests, transport, "batch" if batch else "one").inc()
    errors = limit_errors(traces, limits, batch=batch, body_bytes=body_bytes)
    if errors:
        raise TraceLimitError(errors)
    try:
        evaluations = await evaluator.evaluate(traces, dry_run=dry_run, namespace=namespace)
    except OverloadedError as exc:
        m.child(m.overloaded, exc.reason).inc()
        raise
    m.child(m.namespace_evaluations, m.namespace_label(namespace)).inc(len(evaluations))
    for e in evaluations:
        m.child(m.evaluations, e.score.weights.name).inc()
        m.score.observe(e.score.value)
        for rule in e.score.overrides:
            m.child(m.overrides, rule).inc()
        if not e.novelty.measured and e.novelty.reason is not None:
            m.child(m.novelty_unmeasured, e.novelty.reason).inc()
        if e.novelty.search is not None:
            m.child(m.novelty_search, e.novelty.search).inc()
    return evaluations
