"""Evaluating traces: embed, measure novelty against the memory, score.

Embedding happens off the event loop and may interleave between requests. Then the traces of
a request (a batch, in its own order) meet the novelty memory in one step of its single order
(app/memory: in this process, or shared by replicas through Redis), so concurrent results equal
some one-at-a-time order of the same requests.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry.trace import Tracer

from app.core.states import NotStoredReason, NoveltyReason
from app.domain import scoring
from app.embedding.embeddings import Embedder
from app.embedding.types import EmbedderUnavailableError
from app.memory.base import (
    DEFAULT_NAMESPACE,
    MemoryUnavailableError,
    NearestTrace,
    NoveltyMemory,
    SearchMethod,
)
from app.schemas.trace import ReasoningTrace


@dataclass(frozen=True, slots=True)
class NoveltyReport:
    measured: bool
    reason: NoveltyReason | None
    detail: str | None = None
    max_cosine: float | None = None
    cache_size: int = 0
    tokens: int | None = None
    truncated: bool | None = None
    nearest: NearestTrace | None = None
    search: SearchMethod | None = None  # how max_cosine was found (None: not measured)
    search_bound: float | None = None
    #: The trace is in the memory now, committed; else why not (and the storage's own words).
    stored: bool = False
    not_stored: NotStoredReason | None = None
    not_stored_detail: str | None = None


@dataclass(frozen=True, slots=True)
class Evaluation:
    trace_id: str
    score: scoring.Score
    novelty: NoveltyReport
    elapsed_ms: float


class Evaluator:
    def __init__(self, memory: NoveltyMemory, embeddings: Embedder) -> None:
        self.memory = memory
        self.embeddings = embeddings
        #: Set (app/main.py) when traces are exported: the model's and the memory's steps.
        self.tracer: Tracer | None = None

    async def evaluate(
        self,
        traces: Sequence[ReasoningTrace],
        *,
        dry_run: bool = False,
        namespace: str = DEFAULT_NAMESPACE,
        receipt: str | None = None,
    ) -> list[Evaluation]:
        """Score traces in order; each sees its namespace's memory as the ones before it left
        it. NamespaceLimitError (nothing added) when the namespace would pass the limit.
        `receipt`: the memory's (NoveltyMemory.compare), an Idempotency-Key's."""
        started = time.perf_counter()
        texts, ids = [], []
        for trace in traces:
            contents = []
            for step in trace.steps:
                contents.append(step.content)
            texts.append(scoring.novelty_text(trace.task.objective, contents))
            ids.append(trace.id)
        try:
            if self.tracer is None:
                embeddings = await self.embeddings.embed(texts)
            else:
                with self.tracer.start_as_current_span(
                    "kp.embed", attributes={"kp.texts": len(texts)}
                ):
                    embeddings = await self.embeddings.embed(texts)
        except EmbedderUnavailableError as exc:
            report = NoveltyReport(
                False,
                exc.code,
                str(exc),
                cache_size=self.memory.size,
                not_stored="dry_run" if dry_run else "not_measured",
            )
            reports = [report] * len(traces)
        else:
            vectors = []
            for embedding in embeddings:
                vectors.append(embedding.vector)
            unavailable = None
            try:
                add = not dry_run
                if self.tracer is None:
                    comparisons = await self.memory.compare(
                        namespace, vectors, ids, add=add, receipt=receipt
                    )
                else:
                    with self.tracer.start_as_current_span("kp.memory", attributes={"kp.add": add}):
                        comparisons = await self.memory.compare(
                            namespace, vectors, ids, add=add, receipt=receipt
                        )
            except MemoryUnavailableError as exc:
                unavailable = str(exc)
            reports = []
            for i, e in enumerate(embeddings):
                if unavailable is not None:
                    report = NoveltyReport(
                        False,
                        "cache_unavailable",
                        unavailable,
                        tokens=e.token_count,
                        truncated=e.truncated,
                        not_stored="dry_run" if dry_run else "cache_unavailable",
                        not_stored_detail=None if dry_run else unavailable,
                    )
                else:
                    c = comparisons[i]
                    measured = c.max_cosine is not None
                    not_stored: NotStoredReason | None = None
                    if not c.stored:
                        not_stored = "dry_run" if dry_run else "storage_failed"
                    report = NoveltyReport(
                        measured,
                        None if measured else "cache_empty",
                        max_cosine=c.max_cosine,
                        cache_size=c.size,
                        tokens=e.token_count,
                        truncated=e.truncated,
                        nearest=c.nearest,
                        search=c.search if measured else None,
                        search_bound=c.search_bound,
                        stored=c.stored,
                        not_stored=not_stored,
                        not_stored_detail=None if dry_run else c.not_stored,
                    )
                reports.append(report)

        results = []
        for trace, report in zip(traces, reports, strict=True):
            cosine = report.max_cosine
            result = scoring.score(
                trace.steps,
                novelty=scoring.NEUTRAL_NOVELTY if cosine is None else scoring.novelty(cosine),
                confidence=trace.outcome.confidence,
                success=trace.metadata.success,
                task_domain=trace.metadata.task_domain,
            )
            elapsed = (time.perf_counter() - started) * 1000.0
            results.append(Evaluation(trace.id, result, report, elapsed))
        return results
