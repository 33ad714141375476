"""The worker threads that run the model, and the choice of each one's next run
(docs/decisions/embedding-scheduler.md): a request alone gets one run over all cores; under
load each free worker takes a share of the queue and runs it on one core. A worker takes its
next run itself, without a round trip through the event loop (busy with HTTP under load, it
would leave the cores idle between runs). A run that fails is retried one request at a time,
so one bad input fails alone.

Admission turns real overload away, and only that: its limits are counts and wall time the
operator sets, never this machine's speed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from app.embedding.types import (
    EmbedderUnavailableError,
    Embedding,
    EmbedObserver,
    NoObserver,
    Outcome,
    OverloadedError,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class QueueLimits:
    queue_limit: int = 256
    max_wait_ms: float = 10_000.0

    def check_door(self, queued: int, count: int) -> None:
        """OverloadedError if `count` more texts would pass the queue limit (a request larger
        than the limit is still taken when nothing else waits: it is not overload)."""
        if queued and queued + count > self.queue_limit:
            raise OverloadedError(
                f"{queued} texts are waiting for the model "
                f"(limit {self.queue_limit}, KP_EMBED_QUEUE_LIMIT)",
                "queue_limit",
            )

    def expired(self, waited_s: float) -> OverloadedError | None:
        """The error for a request that waited `waited_s` past the limit, or None."""
        waited_ms = waited_s * 1000
        if waited_ms <= self.max_wait_ms:
            return None
        return OverloadedError(
            f"waited {waited_ms:.0f} ms for the model "
            f"(limit {self.max_wait_ms:g} ms, KP_EMBED_MAX_WAIT_MS)",
            "waited_too_long",
        )


def _never() -> bool:
    return False


@dataclass(slots=True)
class Job:
    """One request's texts; `settle` gets its outcome, once, from whichever thread has it."""

    texts: Sequence[str]
    settle: Callable[[Outcome], None] = field(repr=False)
    #: True once nobody awaits the outcome any more (the client went away).
    abandoned: Callable[[], bool] = field(default=_never, repr=False)
    queued_at: float = field(default_factory=time.monotonic)
    #: When its model run started and ended (time.monotonic), once it ran.
    run_started: float | None = None
    run_ended: float | None = None


class JobQueue:
    """Jobs in arrival order, with the count of their texts."""

    def __init__(self) -> None:
        self._jobs: deque[Job] = deque()
        self.texts = 0

    def __len__(self) -> int:
        return len(self._jobs)

    def put(self, job: Job) -> None:
        self._jobs.append(job)
        self.texts += len(job.texts)

    def drain(self) -> list[Job]:
        jobs = list(self._jobs)
        self._jobs.clear()
        self.texts = 0
        return jobs

    def pop_stale(self, is_stale: Callable[[Job], bool]) -> list[Job]:
        """Removes the jobs at the head for which `is_stale` holds, up to the first that does
        not (the head is the oldest: later ones waited less)."""
        stale = []
        while self._jobs and is_stale(self._jobs[0]):
            job = self._jobs.popleft()
            self.texts -= len(job.texts)
            stale.append(job)
        return stale

    def take(self, max_texts: int) -> list[Job]:
        """The oldest job and the next ones in order, up to `max_texts` texts (the model run
        groups their texts by length: onnx_embedder.length_groups)."""
        jobs: list[Job] = []
        size = 0
        while self._jobs and (not jobs or size + len(self._jobs[0].texts) <= max_texts):
            job = self._jobs.popleft()
            jobs.append(job)
            size += len(job.texts)
        self.texts -= size
        return jobs


#: Texts one one-core run takes at most while other workers run too: a worker's requests all
#: wait for its run, so a share stays small.
ONE_CORE_RUN_TEXTS: Final = 2

#: One model run over `texts` (on all cores, or on one): what the scheduler calls on a worker.
Backend = Callable[[list[str], bool], list[Embedding]]


@dataclass(frozen=True, slots=True)
class Run:
    jobs: list[Job]
    one_core: bool
    width: int  # workers it occupies: all of them for a run over every core
    count: int  # texts in the run


class RunScheduler:
    """The queue, its admission and the workers, under one lock (a worker's choice depends on
    both the queue and which workers are idle). `backend` is public: the seam tests wrap."""

    def __init__(
        self,
        backend: Backend,
        *,
        workers: int = 1,
        batch_size: int = 32,
        limits: QueueLimits | None = None,
        observer: EmbedObserver | None = None,
    ) -> None:
        self.backend = backend
        self.workers = workers
        self.batch_size = batch_size
        self.limits = limits or QueueLimits()
        self.observer: EmbedObserver = observer or NoObserver()
        self._lock = threading.Condition()
        self._queue = JobQueue()
        self._running_texts = 0
        self._idle_workers = workers
        self._closing = False
        self._threads: list[threading.Thread] = []
        #: Model calls made, on every core (a request alone) and on one core (side by side).
        self.runs_total = {"all_cores": 0, "one_core": 0}

    @property
    def queue_depth(self) -> int:
        """Texts waiting for the model or in it."""
        return self._queue.texts + self._running_texts

    @property
    def idle_workers(self) -> int:
        """Workers not running the model now (a run over every core takes them all)."""
        return self._idle_workers

    def start(self) -> bool:
        """Starts the workers; False if closing already."""
        with self._lock:
            if self._closing or self._threads:
                return not self._closing
            self._threads = [
                threading.Thread(target=self._work, name=f"embedder-{i}", daemon=True)
                for i in range(self.workers)
            ]
        for thread in self._threads:
            thread.start()
        return True

    def submit(
        self,
        texts: Sequence[str],
        settle: Callable[[Outcome], None],
        abandoned: Callable[[], bool] = _never,
    ) -> Job:
        """Queues `texts`; `settle` gets their outcome from a worker. Raises OverloadedError
        at the door, EmbedderUnavailableError once closing."""
        job = Job(texts, settle, abandoned)
        with self._lock:
            if self._closing:
                raise EmbedderUnavailableError("the service is shutting down")
            self.limits.check_door(self._queue.texts + self._running_texts, len(texts))
            self._queue.put(job)
            self._lock.notify()
        return job

    def close(self) -> None:
        """Workers stop after their current run; requests still waiting fail."""
        with self._lock:
            self._closing = True
            waiting = self._queue.drain()
            self._lock.notify_all()
        for job in waiting:
            job.settle(EmbedderUnavailableError("the service is shutting down"))

    def join(self) -> None:
        for thread in self._threads:
            thread.join()

    # ── on the worker threads ───────────────────────────────────────────────

    def _work(self) -> None:
        while True:
            with self._lock:
                run = self._next_run()
            if run is None:
                return
            started = time.monotonic()
            for job in run.jobs:
                job.run_started = started
                self.observer.queue_waited(started - job.queued_at)
            outcomes = self._run_jobs(run.jobs, one_core=run.one_core)
            ended = time.monotonic()
            with self._lock:
                self._running_texts -= run.count
                self._idle_workers += run.width
                self._lock.notify_all()
            # Only now: a client answered at once sends its next request at once, and the door
            # must not count this run as still going (a needless 503 at one client).
            for job, outcome in outcomes:
                job.run_ended = ended
                job.settle(outcome)

    def _next_run(self) -> Run | None:
        """Under the lock: waits for work a free worker may take; None once closing."""
        while True:
            if self._closing:
                return None
            self._shed_stale()
            if self._queue and self._idle_workers:
                break
            self._lock.wait()
        queued = self._queue.texts
        if self._idle_workers == self.workers and len(self._queue) == 1:
            run = Run(self._queue.take(1), False, self.workers, queued)
        elif self.workers == 1:
            run = Run(self._queue.take(self.batch_size), False, 1, queued - self._queue.texts)
        else:
            # A share small enough to be one model run: a worker's jobs all wait for it.
            share = -(-queued // self._idle_workers)  # rounded up
            jobs = self._queue.take(min(share, ONE_CORE_RUN_TEXTS))
            run = Run(jobs, True, 1, queued - self._queue.texts)
        self._running_texts += run.count
        self._idle_workers -= run.width
        return run

    def _shed_stale(self) -> None:
        """Under the lock: drops the jobs at the head that nobody awaits any more, and turns
        away those that waited past the limit (the guarantee that the queue never piles up)."""
        now = time.monotonic()
        expired = self.limits.expired

        def stale(job: Job) -> bool:
            return expired(now - job.queued_at) is not None or job.abandoned()

        for job in self._queue.pop_stale(stale):
            error = expired(now - job.queued_at)
            if error is not None:
                job.settle(error)

    def _run_jobs(self, jobs: list[Job], *, one_core: bool) -> list[tuple[Job, Outcome]]:
        """One model run for all jobs; if it fails, each job alone."""
        texts: list[str] = []
        for job in jobs:
            texts.extend(job.texts)
        started = time.monotonic()
        try:
            embeddings = self.backend(texts, one_core)
        except Exception as exc:
            if len(jobs) > 1:
                retried: list[tuple[Job, Outcome]] = []
                for job in jobs:
                    retried += self._run_jobs([job], one_core=one_core)
                return retried
            log.exception("embedding failed for one request", extra={"texts": len(texts)})
            failure = EmbedderUnavailableError(
                f"embedding failed: {type(exc).__name__}", "embedding_failed"
            )
            return [(jobs[0], failure)]
        self.observer.model_ran(time.monotonic() - started)
        with self._lock:
            self.runs_total["one_core" if one_core else "all_cores"] += 1
        outcomes: list[tuple[Job, Outcome]] = []
        start = 0
        for job in jobs:
            outcomes.append((job, embeddings[start : start + len(job.texts)]))
            start += len(job.texts)
        return outcomes
