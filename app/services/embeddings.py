"""The embedder as the service runs it: loaded once, lazily, fed by one dispatching task.

Requests put their texts on a queue; one task hands them to the model's worker threads:

- a request alone (nothing else waiting, every worker idle) gets one run over all cores, the
  lowest latency one text can have;
- under load each idle worker takes a share of the queue and runs it on one core: runs side by
  side do more per second than runs one after another over all cores. A share holds requests
  of similar length, and texts of similar token length share one model run, which keeps
  padding small (padding does not change a vector: the attention mask hides it and the pooling
  ignores it). No request ever waits for others to arrive.

Overload is decided at the door: a request that would wait longer than `max_wait_ms` for a
worker (the work queued ahead of it at the recent cost per text), or that would put more than
`queue_limit` texts in the queue, gets OverloadedError at once instead of joining a pile-up.
Should the forecast be wrong, a request that has waited `max_wait_ms` is turned away when its
turn comes, so no request ever starts later than that.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

import numpy as np
import numpy.typing as npt

from app.embedding.onnx_embedder import ModelError, OnnxEmbedder, Precision, TokenizedText

log = logging.getLogger(__name__)

#: Weight of the newest run in the running estimate of the model's cost per text.
_COST_SMOOTHING = 0.2
#: Texts of similar length one one-core run takes at most, while other workers run too.
_ONE_CORE_RUN_TEXTS = 2


class EmbedderState(StrEnum):
    DISABLED = "disabled"
    NOT_LOADED = "not_loaded"
    LOADING = "loading"
    READY = "ready"
    UNAVAILABLE = "unavailable"


class EmbedderUnavailableError(Exception):
    """No embedding can be had for these texts; novelty falls back to 0.5."""

    def __init__(
        self,
        detail: str,
        code: Literal["embedder_unavailable", "embedding_failed"] = "embedder_unavailable",
    ) -> None:
        super().__init__(detail)
        self.code = code


OverloadReason = Literal["queue_limit", "expected_wait", "waited_too_long"]


class OverloadedError(Exception):
    """Too many texts are waiting for the model; `reason` says which guard turned it away."""

    def __init__(self, detail: str, reason: OverloadReason) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Embedding:
    vector: npt.NDArray[np.float32]
    token_count: int
    truncated: bool


@dataclass(slots=True)
class _Job:
    texts: Sequence[str]
    future: asyncio.Future[list[Embedding]] = field(repr=False)
    queued_at: float = field(default_factory=time.monotonic)

    @property
    def chars(self) -> int:
        """Length of the longest text: a cheap stand-in for its token count."""
        return max((len(t) for t in self.texts), default=0)


EmbedderFactory = Callable[[], OnnxEmbedder]


class EmbeddingService:
    """Owns the embedder's life cycle (state, reason) and the queue in front of it."""

    def __init__(
        self,
        factory: EmbedderFactory | None,
        *,
        model_name: str | None,
        precision: Precision | None = None,
        workers: int = 1,
        batch_size: int = 32,
        queue_limit: int = 256,
        max_wait_ms: float = 60.0,
    ) -> None:
        self._factory = factory
        self.model_name = model_name
        self.precision = precision
        self.state = EmbedderState.DISABLED if factory is None else EmbedderState.NOT_LOADED
        self.reason: str | None = "disabled by KP_EMBEDDER=none" if factory is None else None
        self.workers = workers
        self._batch_size = batch_size
        self._queue_limit = queue_limit
        self._max_wait_ms = max_wait_ms
        self._embedder: OnnxEmbedder | None = None
        self._load_task: asyncio.Task[None] | None = None
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="embedder")
        self._waiting: deque[_Job] = deque()
        self._waiting_texts = 0
        self._running_texts = 0
        self._idle_workers = workers
        self._wake_dispatcher = asyncio.Event()
        self._dispatcher: asyncio.Task[None] | None = None
        self._runs: set[asyncio.Task[None]] = set()
        #: Worker-milliseconds one text costs, from recent runs (None before the first run).
        self.cost_per_text_ms: float | None = None
        #: Model calls made, on every core (a request alone) and on one core (side by side).
        self.runs_total = {"all_cores": 0, "one_core": 0}

    @property
    def queue_depth(self) -> int:
        """Texts waiting for the model or in it."""
        return self._waiting_texts + self._running_texts

    @property
    def degraded(self) -> bool:
        return self.state in (EmbedderState.DISABLED, EmbedderState.UNAVAILABLE)

    def expected_wait_ms(self) -> float:
        """How long a request arriving now would wait for a worker, from the recent cost."""
        if not self._waiting_texts and self._idle_workers:
            return 0.0
        if self.cost_per_text_ms is None:
            return 0.0
        # Runs in progress are, on average, half done.
        ahead = self._waiting_texts + self._running_texts / 2
        return ahead * self.cost_per_text_ms / self.workers

    # ── life cycle ──────────────────────────────────────────────────────────

    async def load(self) -> None:
        """Load the model once; concurrent callers wait for the same load."""
        if self._factory is None or self.state in (EmbedderState.READY, EmbedderState.UNAVAILABLE):
            return
        if self._load_task is None:
            self._load_task = asyncio.create_task(self._load())
        await asyncio.shield(self._load_task)

    async def _load(self) -> None:
        assert self._factory is not None
        self.state = EmbedderState.LOADING
        log.info("embedder loading", extra={"model": self.model_name})
        loop = asyncio.get_running_loop()
        try:
            self._embedder = await loop.run_in_executor(self._executor, self._factory)
        except ModelError as exc:
            self.mark_unavailable(str(exc))
            return
        except Exception as exc:  # onnxruntime raises many types for a bad file
            self.mark_unavailable(f"{type(exc).__name__}: {exc}")
            return
        self.state = EmbedderState.READY
        self._dispatcher = asyncio.create_task(self._dispatch(), name="embedding-dispatcher")
        log.info(
            "embedder ready",
            extra={"model": self.model_name, "precision": self.precision, "workers": self.workers},
        )

    def mark_unavailable(self, reason: str) -> None:
        self.state = EmbedderState.UNAVAILABLE
        self.reason = reason
        log.error("embedder unavailable; novelty is not measured", extra={"reason": reason})

    async def close(self) -> None:
        tasks = [*self._runs, *([self._dispatcher] if self._dispatcher else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._executor.shutdown(wait=True, cancel_futures=True)

    # ── embedding ───────────────────────────────────────────────────────────

    async def embed(self, texts: Sequence[str]) -> list[Embedding]:
        """Embeddings in the order of `texts`, or EmbedderUnavailableError / OverloadedError."""
        await self.load()
        if self.state is not EmbedderState.READY:
            raise EmbedderUnavailableError(self.reason or self.state.value)
        self._admit(len(texts))
        future: asyncio.Future[list[Embedding]] = asyncio.get_running_loop().create_future()
        self._waiting.append(_Job(texts, future))
        self._waiting_texts += len(texts)
        self._wake_dispatcher.set()
        return await future

    def _admit(self, count: int) -> None:
        """OverloadedError unless `count` more texts can be embedded within the limits."""
        if self.queue_depth and self.queue_depth + count > self._queue_limit:
            raise OverloadedError(
                f"{self.queue_depth} texts are waiting for the model "
                f"(limit {self._queue_limit}, KP_EMBED_QUEUE_LIMIT)",
                "queue_limit",
            )
        wait = self.expected_wait_ms()
        if wait > self._max_wait_ms:
            raise OverloadedError(
                f"the model is about {wait:.0f} ms behind "
                f"(limit {self._max_wait_ms:g} ms, KP_EMBED_MAX_WAIT_MS)",
                "expected_wait",
            )

    async def _dispatch(self) -> None:
        """Hands waiting jobs to idle workers, for as long as the service runs."""
        while True:
            while not (self._waiting and self._idle_workers):
                self._wake_dispatcher.clear()
                await self._wake_dispatcher.wait()
            if self._shed_stale():
                continue
            if self._idle_workers == self.workers and len(self._waiting) == 1:
                jobs, width = [self._waiting.popleft()], self.workers  # alone: every core
            elif self.workers == 1:
                jobs, width = self._take(self._batch_size), 1
            else:
                # A share small enough to be one model run: a worker's jobs all wait for it.
                share = -(-self._waiting_texts // self._idle_workers)  # rounded up
                jobs, width = self._take(min(share, _ONE_CORE_RUN_TEXTS), similar=True), 1
            count = sum(len(job.texts) for job in jobs)
            self._waiting_texts -= count
            self._running_texts += count
            self._idle_workers -= width
            run = asyncio.create_task(self._run(jobs, width, count))
            self._runs.add(run)
            run.add_done_callback(self._runs.discard)

    def _shed_stale(self) -> bool:
        """Turns the oldest job away if it has waited past the limit after all: the estimate at
        the door is a forecast, and this is the guarantee that the queue never piles up."""
        job = self._waiting[0]
        waited_ms = (time.monotonic() - job.queued_at) * 1000
        if waited_ms <= self._max_wait_ms and not job.future.done():
            return False
        self._waiting.popleft()
        self._waiting_texts -= len(job.texts)
        if not job.future.done():
            job.future.set_exception(
                OverloadedError(
                    f"waited {waited_ms:.0f} ms for the model "
                    f"(limit {self._max_wait_ms:g} ms, KP_EMBED_MAX_WAIT_MS)",
                    "waited_too_long",
                )
            )
        return True

    def _take(self, max_texts: int, *, similar: bool = False) -> list[_Job]:
        """The oldest job and, up to `max_texts` texts, more (of similar length if asked)."""
        first = self._waiting.popleft()
        jobs, size = [first], len(first.texts)
        low, high = first.chars / 1.15 - 8, first.chars * 1.15 + 8
        for job in list(self._waiting):
            if size + len(job.texts) > max_texts:
                if similar:
                    continue
                break
            if similar and not low <= job.chars <= high:
                continue
            self._waiting.remove(job)
            jobs.append(job)
            size += len(job.texts)
        return jobs

    async def _run(self, jobs: list[_Job], width: int, count: int) -> None:
        try:
            await self._run_jobs(jobs, one_core=width < self.workers)
        finally:
            self._running_texts -= count
            self._idle_workers += width
            self._wake_dispatcher.set()

    async def _run_jobs(self, jobs: list[_Job], *, one_core: bool) -> None:
        """One model run for all jobs; if it fails, each job alone, so one bad input fails alone."""
        texts = [text for job in jobs for text in job.texts]
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        try:
            embeddings = await loop.run_in_executor(
                self._executor, self._embed_now, texts, one_core
            )
        except Exception as exc:
            if len(jobs) > 1:
                for job in jobs:
                    await self._run_jobs([job], one_core=one_core)
                return
            log.exception("embedding failed for one request", extra={"texts": len(texts)})
            failure = EmbedderUnavailableError(
                f"embedding failed: {type(exc).__name__}", "embedding_failed"
            )
            if not jobs[0].future.done():
                jobs[0].future.set_exception(failure)
            return
        cores = 1 if one_core else self.workers
        self._record_cost((time.perf_counter() - started) * 1000 * cores / len(texts))
        self.runs_total["one_core" if one_core else "all_cores"] += 1
        start = 0
        for job in jobs:
            if not job.future.done():  # the client may have gone away
                job.future.set_result(embeddings[start : start + len(job.texts)])
            start += len(job.texts)

    def _record_cost(self, ms_per_text: float) -> None:
        previous = self.cost_per_text_ms
        self.cost_per_text_ms = (
            ms_per_text
            if previous is None
            else previous + _COST_SMOOTHING * (ms_per_text - previous)
        )

    def _embed_now(self, texts: list[str], one_core: bool = False) -> list[Embedding]:
        """Runs on a worker thread: tokenize, group by length, run the model per group."""
        assert self._embedder is not None
        tokenized = self._embedder.tokenize(texts)
        vectors: list[npt.NDArray[np.float32] | None] = [None] * len(texts)
        for group in length_groups(tokenized, self._batch_size):
            rows = self._embedder.embed_tokenized([tokenized[i] for i in group], one_core=one_core)
            for i, row in zip(group, rows, strict=True):
                vectors[i] = row
        return [
            Embedding(vector, t.token_count, t.truncated)
            for vector, t in zip(vectors, tokenized, strict=True)
            if vector is not None
        ]


def length_groups(
    tokenized: Sequence[TokenizedText], max_size: int, max_padding: float = 0.25
) -> list[list[int]]:
    """Indices grouped into model runs of similar length (padding at most `max_padding`)."""
    order = sorted(range(len(tokenized)), key=lambda i: len(tokenized[i].ids))
    groups: list[list[int]] = []
    for i in order:
        length = len(tokenized[i].ids)
        if groups:
            group = groups[-1]
            shortest = len(tokenized[group[0]].ids)
            if len(group) < max_size and length <= shortest * (1 + max_padding) + 4:
                group.append(i)
                continue
        groups.append([i])
    return groups
