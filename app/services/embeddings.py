"""The embedder as the service runs it: loaded once, lazily, run by its own worker threads.

Requests put their texts on a queue; each worker thread takes its next run from it as soon as
it is free, without a round trip through the event loop (which is busy with HTTP under load,
and would leave the cores idle between runs), and hands the vectors back to the loop:

- a request alone (nothing else waiting, every worker idle) gets one run over all cores, the
  lowest latency one text can have;
- under load each free worker takes a share of the queue and runs it on one core: runs side
  by side do more per second than runs one after another over all cores. A share holds
  requests of similar length, and texts of similar token length share one model run, which
  keeps padding small (padding does not change a vector: the attention mask hides it and the
  pooling ignores it). No request ever waits for others to arrive.

Overload is decided at the door: a request that would wait longer than 3/4 of `max_wait_ms`
for a worker (the work queued ahead of it at the recent cost per text), or that would put more
than `queue_limit` texts in the queue, gets OverloadedError at once instead of joining a
pile-up.
Should the forecast be wrong, a request that has waited `max_wait_ms` is turned away when its
turn comes, so no request ever starts later than that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

import numpy as np
import numpy.typing as npt

from app.embedding.onnx_embedder import (
    WARM_UP_TEXT,
    ModelError,
    OnnxEmbedder,
    Precision,
    TokenizedText,
)

log = logging.getLogger(__name__)

#: Weight of the newest run in the running estimate of the model's cost per text.
_COST_SMOOTHING = 0.2
#: The door turns a request away once its forecast wait passes this share of the limit. A
#: forecast is an average: at the full limit, more than half of a 16-client run's 503s came
#: late, after waiting the whole limit for nothing; at 3/4 almost all come at once.
_DOOR_SHARE = 0.75
#: Runs through the queue at load time, before the service reports itself ready.
_WARM_UP_REQUESTS = 3
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


#: What a request gets back from the model: its vectors, or why there are none.
Outcome = list[Embedding] | BaseException


@dataclass(slots=True)
class _Job:
    """One request's texts and the future its coroutine awaits (settled on the loop)."""

    texts: Sequence[str]
    future: asyncio.Future[list[Embedding]] = field(repr=False)
    queued_at: float = field(default_factory=time.monotonic)

    @property
    def chars(self) -> int:
        """Length of the longest text: a cheap stand-in for its token count."""
        return max((len(t) for t in self.texts), default=0)

    def settle(self, outcome: Outcome) -> None:
        """Thread-safe: hands the outcome to the job's event loop (if anyone still waits)."""
        # A closed loop raises RuntimeError: nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            self.future.get_loop().call_soon_threadsafe(_set_outcome, self.future, outcome)


def _set_outcome(future: asyncio.Future[list[Embedding]], outcome: Outcome) -> None:
    if future.done():  # the client went away
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


@dataclass(frozen=True, slots=True)
class _Run:
    jobs: list[_Job]
    one_core: bool
    width: int  # workers it occupies: all of them for a run over every core

    @property
    def count(self) -> int:
        """Texts in the run."""
        return sum(len(job.texts) for job in self.jobs)


EmbedderFactory = Callable[[], OnnxEmbedder]


class EmbeddingService:
    """Owns the embedder's life cycle (state, reason), the queue and the worker threads.

    The queue and its counters are shared by the event loop (which adds jobs and reads the
    counters at the door) and the workers (which take jobs): `_lock` guards them.
    """

    def __init__(
        self,
        factory: EmbedderFactory | None,
        *,
        model_name: str | None,
        precision: Precision | None = None,
        precision_reason: str | None = None,
        workers: int = 1,
        batch_size: int = 32,
        queue_limit: int = 256,
        max_wait_ms: float = 60.0,
    ) -> None:
        self._factory = factory
        self.model_name = model_name
        self.precision = precision
        #: With KP_EMBEDDER_PRECISION=int8: which int8 products run, or why float32 instead.
        self.precision_reason = precision_reason
        self.state = EmbedderState.DISABLED if factory is None else EmbedderState.NOT_LOADED
        self.reason: str | None = "disabled by KP_EMBEDDER=none" if factory is None else None
        self.workers = workers
        self._batch_size = batch_size
        self._queue_limit = queue_limit
        self._max_wait_ms = max_wait_ms
        self._embedder: OnnxEmbedder | None = None
        self._load_task: asyncio.Task[None] | None = None
        self._lock = threading.Condition()
        self._waiting: deque[_Job] = deque()
        self._waiting_texts = 0
        self._running_texts = 0
        self._idle_workers = workers
        self._closing = False
        self._threads: list[threading.Thread] = []
        #: Worker-milliseconds one text costs, from recent runs (None before the first run).
        self.cost_per_text_ms: float | None = None
        #: Model calls made, on every core (a request alone) and on one core (side by side).
        self.runs_total = {"all_cores": 0, "one_core": 0}

    @property
    def queue_depth(self) -> int:
        """Texts waiting for the model or in it."""
        return self._waiting_texts + self._running_texts

    @property
    def idle_workers(self) -> int:
        """Workers not running the model now (a run over every core takes them all)."""
        return self._idle_workers

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
        try:
            self._embedder = await asyncio.to_thread(self._factory)
        except ModelError as exc:
            self.mark_unavailable(str(exc))
            return
        except Exception as exc:  # onnxruntime raises many types for a bad file
            self.mark_unavailable(f"{type(exc).__name__}: {exc}")
            return
        with self._lock:
            if self._closing:
                return
            warmed = threading.Barrier(self.workers + 1)
            self._threads = [
                threading.Thread(
                    target=self._work, args=(warmed,), name=f"embedder-{i}", daemon=True
                )
                for i in range(self.workers)
            ]
        for thread in self._threads:
            thread.start()
        await asyncio.to_thread(warmed.wait)
        # Then the request path itself a few times, queue to worker to event loop: with only
        # the workers' own warm-up runs, a preloaded service's first request still ran a
        # median 4-7 ms slower than its tenth (the model run itself, on a worker just woken);
        # after these, 1-1.5 ms, as with the thread pool these workers replaced.
        try:
            for _ in range(_WARM_UP_REQUESTS):
                await self._queued([WARM_UP_TEXT])
        except OverloadedError:
            pass  # turned away under a tiny KP_EMBED_MAX_WAIT_MS: not worth failing the load for
        except EmbedderUnavailableError as exc:
            if not self._closing:
                self.mark_unavailable(f"warm-up run failed: {exc}")
            return
        self.state = EmbedderState.READY
        log.info(
            "embedder ready",
            extra={
                "model": self.model_name,
                "precision": self.precision,
                "precision_reason": self.precision_reason,
                "workers": self.workers,
            },
        )

    def mark_unavailable(self, reason: str) -> None:
        self.state = EmbedderState.UNAVAILABLE
        self.reason = reason
        log.error("embedder unavailable; novelty is not measured", extra={"reason": reason})

    async def close(self) -> None:
        """Stops the workers after their current run; requests still waiting fail."""
        with self._lock:
            self._closing = True
            waiting = list(self._waiting)
            self._waiting.clear()
            self._waiting_texts = 0
            self._lock.notify_all()
        for job in waiting:
            _set_outcome(job.future, EmbedderUnavailableError("the service is shutting down"))
        if self._load_task is not None:
            await asyncio.gather(self._load_task, return_exceptions=True)
        for thread in self._threads:
            await asyncio.to_thread(thread.join)

    # ── embedding ───────────────────────────────────────────────────────────

    async def embed(self, texts: Sequence[str]) -> list[Embedding]:
        """Embeddings in the order of `texts`, or EmbedderUnavailableError / OverloadedError."""
        await self.load()
        if self.state is not EmbedderState.READY:
            raise EmbedderUnavailableError(self.reason or self.state.value)
        return await self._queued(texts)

    async def _queued(self, texts: Sequence[str]) -> list[Embedding]:
        """Through the queue and a worker, as every request goes."""
        future: asyncio.Future[list[Embedding]] = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._closing:
                raise EmbedderUnavailableError("the service is shutting down")
            self._admit(len(texts))
            self._waiting.append(_Job(texts, future))
            self._waiting_texts += len(texts)
            self._lock.notify()
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
        door = self._max_wait_ms * _DOOR_SHARE
        if wait > door:
            raise OverloadedError(
                f"the model is about {wait:.0f} ms behind (turned away past {door:.0f} ms, "
                f"3/4 of KP_EMBED_MAX_WAIT_MS={self._max_wait_ms:g})",
                "expected_wait",
            )

    # ── worker threads ──────────────────────────────────────────────────────

    def _work(self, warmed: threading.Barrier) -> None:
        """A worker thread: takes the next run, runs it, for as long as the service runs."""
        assert self._embedder is not None
        try:
            self._embedder.warm_up()  # its own first run, out of the first request's way
        except Exception:
            log.exception("embedder warm-up failed on a worker thread")
        finally:
            warmed.wait()
        while True:
            with self._lock:
                run = self._next_run()
            if run is None:
                return
            outcomes = self._run_jobs(run.jobs, one_core=run.one_core)
            with self._lock:
                self._running_texts -= run.count
                self._idle_workers += run.width
                self._lock.notify_all()
            # Only now: a client answered at once sends its next request at once, and the door
            # must not count this run as still going (a needless 503 at one client).
            for job, outcome in outcomes:
                job.settle(outcome)

    def _next_run(self) -> _Run | None:
        """Under the lock: waits for work a free worker may take; None once closing."""
        while True:
            if self._closing:
                return None
            self._shed_stale()
            if self._waiting and self._idle_workers:
                break
            self._lock.wait()
        if self._idle_workers == self.workers and len(self._waiting) == 1:
            run = _Run([self._waiting.popleft()], one_core=False, width=self.workers)
        elif self.workers == 1:
            run = _Run(self._take(self._batch_size), one_core=False, width=1)
        else:
            # A share small enough to be one model run: a worker's jobs all wait for it.
            share = -(-self._waiting_texts // self._idle_workers)  # rounded up
            jobs = self._take(min(share, _ONE_CORE_RUN_TEXTS), similar=True)
            run = _Run(jobs, one_core=True, width=1)
        self._waiting_texts -= run.count
        self._running_texts += run.count
        self._idle_workers -= run.width
        return run

    def _shed_stale(self) -> None:
        """Under the lock: drops the jobs at the head that nobody awaits any more, and turns
        away those that waited past the limit after all (the estimate at the door is a
        forecast; this is the guarantee that the queue never piles up)."""
        now = time.monotonic()
        while self._waiting:
            job = self._waiting[0]
            waited_ms = (now - job.queued_at) * 1000
            if waited_ms <= self._max_wait_ms and not job.future.done():
                return
            self._waiting.popleft()
            self._waiting_texts -= len(job.texts)
            job.settle(
                OverloadedError(
                    f"waited {waited_ms:.0f} ms for the model "
                    f"(limit {self._max_wait_ms:g} ms, KP_EMBED_MAX_WAIT_MS)",
                    "waited_too_long",
                )
            )

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

    def _run_jobs(self, jobs: list[_Job], *, one_core: bool) -> list[tuple[_Job, Outcome]]:
        """One model run for all jobs; if it fails, each job alone, so one bad input fails alone."""
        texts = [text for job in jobs for text in job.texts]
        started = time.perf_counter()
        try:
            embeddings = self._embed_now(texts, one_core)
        except Exception as exc:
            if len(jobs) > 1:
                return [out for job in jobs for out in self._run_jobs([job], one_core=one_core)]
            log.exception("embedding failed for one request", extra={"texts": len(texts)})
            failure = EmbedderUnavailableError(
                f"embedding failed: {type(exc).__name__}", "embedding_failed"
            )
            return [(jobs[0], failure)]
        cores = 1 if one_core else self.workers
        with self._lock:
            self._record_cost((time.perf_counter() - started) * 1000 * cores / len(texts))
            self.runs_total["one_core" if one_core else "all_cores"] += 1
        outcomes: list[tuple[_Job, Outcome]] = []
        start = 0
        for job in jobs:
            outcomes.append((job, embeddings[start : start + len(job.texts)]))
            start += len(job.texts)
        return outcomes

    def _record_cost(self, ms_per_text: float) -> None:
        """Under the lock: folds one run's cost into the running estimate."""
        previous = self.cost_per_text_ms
        self.cost_per_text_ms = (
            ms_per_text
            if previous is None
            else previous + _COST_SMOOTHING * (ms_per_text - previous)
        )

    def _embed_now(self, texts: list[str], one_core: bool = False) -> list[Embedding]:
        """Tokenize, group by length, run the model per group (on a worker thread)."""
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
