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

Admission is two plain limits, both for real overload only: a request that would put more
than `queue_limit` texts in the queue gets OverloadedError at once, and one that has waited
`max_wait_ms` (seconds, by default) without its run starting gets it when its turn comes.
Everything else waits its turn: load the machine can carry is served later, not refused, on a
fast CPU and on one twice as slow alike.
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
from typing import Literal

import numpy as np
import numpy.typing as npt

from app.core.states import EmbedderState, Precision
from app.embedding.onnx_embedder import (
    WARM_UP_TEXT,
    ModelError,
    OnnxEmbedder,
    TokenizedText,
)

log = logging.getLogger(__name__)

#: Runs through the queue that end the start-up (after the first answer, or before a preloaded
#: service reports itself ready).
_WARM_UP_REQUESTS = 3
#: About the characters of English text that fill the 512-token window.
_WINDOW_CHARS = 3000
#: Texts of similar length one one-core run takes at most, while other workers run too.
_ONE_CORE_RUN_TEXTS = 2


class EmbedderUnavailableError(Exception):
    """No embedding can be had for these texts; novelty falls back to 0.5."""

    def __init__(
        self,
        detail: str,
        code: Literal["embedder_unavailable", "embedding_failed"] = "embedder_unavailable",
    ) -> None:
        super().__init__(detail)
        self.code = code


OverloadReason = Literal["queue_limit", "waited_too_long"]


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
        """Length of the longest text, up to what fills the window: a cheap stand-in for the
        tokens the model reads (a megabyte and a full window cost the same run)."""
        return min(_WINDOW_CHARS, max((len(t) for t in self.texts), default=0))

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
        max_wait_ms: float = 10_000.0,
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
        self._warm_up_task: asyncio.Task[None] | None = None
        self._lock = threading.Condition()
        self._waiting: deque[_Job] = deque()
        self._waiting_texts = 0
        self._running_texts = 0
        self._idle_workers = workers
        self._closing = False
        self._threads: list[threading.Thread] = []
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
    def loaded_fully(self) -> bool:
        """The model is loaded and nothing of its start-up is left to do (see `_warm_up`)."""
        task = self._warm_up_task
        return task is not None and task.done() and self.state is EmbedderState.READY

    @property
    def degraded(self) -> bool:
        return self.state in (EmbedderState.DISABLED, EmbedderState.UNAVAILABLE)

    # ── life cycle ──────────────────────────────────────────────────────────

    async def load(self) -> None:
        """Load the model once (the least the first request needs); concurrent callers wait for
        the same load. The rest of the start-up is `_warm_up`, after the first answer."""
        if self._factory is None or self.state in (EmbedderState.READY, EmbedderState.UNAVAILABLE):
            return
        if self._load_task is None:
            self._load_task = asyncio.create_task(self._load())
        await asyncio.shield(self._load_task)

    async def preload(self) -> None:
        """Load and warm up before the first request (KP_EMBEDDER_PRELOAD): nobody waits yet."""
        await self.load()
        await asyncio.shield(self._warm_up_started())

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
            self._threads = [
                threading.Thread(target=self._work, name=f"embedder-{i}", daemon=True)
                for i in range(self.workers)
            ]
        for thread in self._threads:
            thread.start()
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

    def _warm_up_started(self) -> asyncio.Task[None]:
        """The warm-up, started once: after the first answer, or by preload."""
        if self._warm_up_task is None:
            self._warm_up_task = asyncio.create_task(self._warm_up())
        return self._warm_up_task

    async def _warm_up(self) -> None:
        """What later runs need, kept out of the first request's way (a lazy load runs it after
        the first answer): the single-threaded session for runs side by side, each session's
        first run, and a few runs through the queue. Without the last, a preloaded service's
        first request ran a median 4-7 ms slower than its tenth (the model run itself, on a
        worker just woken); with them, 1-1.5 ms."""
        embedder = self._embedder
        if embedder is None or self.state is not EmbedderState.READY:
            return
        try:
            await asyncio.to_thread(embedder.finish_loading)
            for _ in range(_WARM_UP_REQUESTS):
                await self._queued([WARM_UP_TEXT])
        except OverloadedError:
            pass  # turned away under a tiny queue limit: the service is busy, hence warm
        except EmbedderUnavailableError as exc:
            if not self._closing:
                self.mark_unavailable(f"warm-up run failed: {exc}")
        except Exception as exc:  # the model ran for a request, yet cannot run here
            self.mark_unavailable(f"warm-up run failed: {type(exc).__name__}: {exc}")
        else:
            log.info("embedder warmed up", extra={"runs": dict(self.runs_total)})

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
        for task in (self._load_task, self._warm_up_task):
            if task is not None:
                await asyncio.gather(task, return_exceptions=True)
        for thread in self._threads:
            await asyncio.to_thread(thread.join)

    # ── embedding ───────────────────────────────────────────────────────────

    async def embed(self, texts: Sequence[str]) -> list[Embedding]:
        """Embeddings in the order of `texts`, or EmbedderUnavailableError / OverloadedError."""
        await self.load()
        if self.state is not EmbedderState.READY:
            raise EmbedderUnavailableError(self.reason or self.state.value)
        try:
            return await self._queued(texts)
        finally:
            if not self._closing:  # the first answer is on its way: warm up now
                self._warm_up_started()

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
        """OverloadedError if `count` more texts would pass the queue limit (a request larger
        than the limit is still taken when nothing else waits: it is not overload)."""
        if self.queue_depth and self.queue_depth + count > self._queue_limit:
            raise OverloadedError(
                f"{self.queue_depth} texts are waiting for the model "
                f"(limit {self._queue_limit}, KP_EMBED_QUEUE_LIMIT)",
                "queue_limit",
            )

    # ── worker threads ──────────────────────────────────────────────────────

    def _work(self) -> None:
        """A worker thread: takes the next run, runs it, for as long as the service runs."""
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
        with self._lock:
            self.runs_total["one_core" if one_core else "all_cores"] += 1
        outcomes: list[tuple[_Job, Outcome]] = []
        start = 0
        for job in jobs:
            outcomes.append((job, embeddings[start : start + len(job.texts)]))
            start += len(job.texts)
        return outcomes

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
