"""Evaluating traces: embed, measure novelty against the cache, score.

Embedding happens off the event loop and may interleave between requests. The step that reads
and updates the cache runs on the event loop without awaiting, so each request (and each batch,
in its own order) meets the cache as one atomic step: concurrent results equal some
one-at-a-time order of the same requests.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from app.domain import scoring
from app.domain.vector_cache import VectorCache
from app.schemas.trace import ReasoningTrace
from app.services.embeddings import EmbedderUnavailableError, Embedding, EmbeddingService

NoveltyReason = Literal["embedder_unavailable", "embedding_failed", "cache_empty"]


@dataclass(frozen=True, slots=True)
class NoveltyReport:
    measured: bool
    reason: NoveltyReason | None
    detail: str | None
    max_cosine: float | None
    cache_size: int
    tokens: int | None
    truncated: bool | None


@dataclass(frozen=True, slots=True)
class Evaluation:
    trace_id: str
    score: scoring.Score
    novelty: NoveltyReport
    elapsed_ms: float


class Evaluator:
    def __init__(self, cache: VectorCache, embeddings: EmbeddingService) -> None:
        self.cache = cache
        self.embeddings = embeddings

    async def evaluate(
        self, traces: Sequence[ReasoningTrace], *, dry_run: bool = False
    ) -> list[Evaluation]:
        """Score traces in order; each sees the cache as the ones before it left it."""
        started = time.perf_counter()
        texts = [
            scoring.novelty_text(t.task.objective, [s.content for s in t.steps]) for t in traces
        ]
        embeddings: Sequence[Embedding | None]
        failure: tuple[NoveltyReason, str] | None = None
        try:
            embeddings = await self.embeddings.embed(texts)
        except EmbedderUnavailableError as exc:
            embeddings = [None] * len(traces)
            failure = (exc.code, str(exc))

        # From here on nothing awaits: this batch meets the cache as one step.
        # A dry run of several traces works on a copy, so that later traces still see earlier ones.
        cache = self.cache.copy() if dry_run and len(traces) > 1 else self.cache
        results = []
        for trace, embedding in zip(traces, embeddings, strict=True):
            novelty, report = self._novelty(
                cache, embedding, failure, add=not dry_run or cache is not self.cache
            )
            stats = scoring.StepStats.of(trace.steps)
            result = scoring.score(
                stats,
                novelty=novelty,
                confidence=trace.outcome.confidence,
                success=trace.metadata.success,
                task_domain=trace.metadata.task_domain,
            )
            elapsed = (time.perf_counter() - started) * 1000.0
            results.append(Evaluation(trace.id, result, report, elapsed))
        return results

    @staticmethod
    def _novelty(
        cache: VectorCache,
        embedding: Embedding | None,
        failure: tuple[NoveltyReason, str] | None,
        *,
        add: bool,
    ) -> tuple[float, NoveltyReport]:
        if embedding is None:
            reason, detail = failure or ("embedder_unavailable", None)
            return scoring.NEUTRAL_NOVELTY, NoveltyReport(
                False, reason, detail, None, cache.size, None, None
            )
        size = cache.size
        if size == 0:
            novelty = scoring.NEUTRAL_NOVELTY
            report = NoveltyReport(
                False, "cache_empty", None, None, 0, embedding.token_count, embedding.truncated
            )
        else:
            max_cosine = cache.max_cosine_similarity(embedding.vector)
            novelty = scoring.novelty(max_cosine)
            report = NoveltyReport(
                True, None, None, max_cosine, size, embedding.token_count, embedding.truncated
            )
        if add:
            cache.add(embedding.vector)
        return novelty, report
