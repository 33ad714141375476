"""The worker threads that run the model, and each one's next run: all cores for a request
alone, one core each under load (docs/decisions/embedding-scheduler.md). A worker takes its
next run itself: a round trip through the event loop, busy with HTTP under load, would leave
the cores idle between runs."""

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
    Outcome,
    OverloadedError,
)

log = logging.getLogger(__name__)


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


#: Texts one one-core run takes at most while other workers run too: a worker's requests all
#: wait for its run, so a share stays small.
ONE_CORE_RUN_TEXTS: Final = 2

#: One model run over `texts` (on all cores, or on one): what the scheduler calls on a worker.
Backend = Callable[[list[str], bool], list[Embedding]]


class RunScheduler:
    """The queue (jobs in arrival order), its admission and the workers, under one lock (a
    worker's choice depends on both the queue and which workers are idle). `backend` is
    public: the seam tests wrap."""

    def __init__(
        self,
        backend: Backend,
        *,
        workers: int = 1,
        batch_size: int = 32,
        queue_limit: int = 256,
        max_wait_ms: float = 10_000.0,
        observer: EmbedObserver | None = None,
    ) -> None:
        self.backend = backend
        self.workers = workers
        self.batch_size = batch_size
        self.queue_limit = queue_limit
        self.max_wait_ms = max_wait_ms
        self.observer = observer
        self._lock = threading.Condition()
        self._queue: deque[Job] = deque()
        self._queued_texts = 0
        self._running_texts = 0
        #: Workers not running the model now (a run over every core takes them all).
        self.idle_workers = workers
        self._closing = False
        self._threads: list[threading.Thread] = []
        #: Model calls made, on every core (a request alone) and on one core (side by side).
        self.runs_total = {"all_cores": 0, "one_core": 0}

    @property
    def queue_depth(self) -> int:
        """Texts waiting for the model or in it."""
        return self._queued_texts + self._running_texts

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
            # A request larger than the limit is still taken when nothing else waits: it is
            # not overload.
            queued = self._queued_texts + self._running_texts
            if queued and queued + len(texts) > self.queue_limit:
                raise OverloadedError(
                    f"{queued} texts are waiting for the model "
                    f"(limit {self.queue_limit}, KP_EMBED_QUEUE_LIMIT)",
                    "queue_limit",
                )
            self._queue.append(job)
            self._queued_texts += len(texts)
            self._lock.notify()
        return job

    def close(self) -> None:
        """Workers stop after their current run; requests still waiting fail."""
        with self._lock:
            self._closing = True
            waiting = list(self._queue)
            self._queue.clear()
            self._queued_texts = 0
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
            jobs, one_core, width, count = run
            started = time.monotonic()
            for job in jobs:
                job.run_started = started
                if self.observer is not None:
                    self.observer.queue_waited(started - job.queued_at)
            outcomes = self._run_jobs(jobs, one_core=one_core)
            ended = time.monotonic()
            with self._lock:
                self._running_texts -= count
                self.idle_workers += width
                self._lock.notify_all()
            # Only now: a client answered at once sends its next request at once, and the door
            # must not count this run as still going (a needless 503 at one client).
            for job, outcome in outcomes:
                job.run_ended = ended
                job.settle(outcome)

    def _next_run(self) -> tuple[list[Job], bool, int, int] | None:
        """Under the lock: waits for work a free worker may take; None once closing. A run is
        its jobs, whether it runs on one core, the workers it occupies (all of them for a run
        over every core) and its texts' count."""
        while True:
            if self._closing:
                return None
            self._shed_stale()
            if self._queue and self.idle_workers:
                break
            self._lock.wait()
        one_core, width = False, 1
        if self.idle_workers == self.workers and len(self._queue) == 1:
            max_texts, width = 1, self.workers
        elif self.workers == 1:
            max_texts = self.batch_size
        else:
            # A share small enough to be one model run: a worker's jobs all wait for it.
            share = -(-self._queued_texts // self.idle_workers)  # rounded up
            max_texts, one_core = min(share, ONE_CORE_RUN_TEXTS), True
        # The oldest job and the next ones in order, up to `max_texts` texts (the model run
        # groups their texts by length: onnx_embedder.length_groups).
        jobs = [self._queue.popleft()]
        count = len(jobs[0].texts)
        while self._queue and count + len(self._queue[0].texts) <= max_texts:
            jobs.append(self._queue.popleft())
            count += len(jobs[-1].texts)
        self._queued_texts -= count
        self._running_texts += count
        self.idle_workers -= width
        return jobs, one_core, width, count

    def _shed_stale(self) -> None:
        """Under the lock: drops the jobs at the head that nobody awaits any more, and turns
        away those that waited past the limit (the guarantee that the queue never piles up).
        The head is the oldest: later ones waited less."""
        now = time.monotonic()
        while self._queue:
            job = self._queue[0]
            waited_ms = (now - job.queued_at) * 1000
            stale = waited_ms > self.max_wait_ms
            if not stale and not job.abandoned():
                return
            # Out of the queue before its waiter can wake: its answer sees the queue without it.
            self._queue.popleft()
            self._queued_texts -= len(job.texts)
            if stale:
                job.settle(
                    OverloadedError(
                        f"waited {waited_ms:.0f} ms for the model "
                        f"(limit {self.max_wait_ms:g} ms, KP_EMBED_MAX_WAIT_MS)",
                        "waited_too_long",
                    )
                )

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
        if self.observer is not None:
            self.observer.model_ran(time.monotonic() - started)
        with self._lock:
            self.runs_total["one_core" if one_core else "all_cores"] += 1
        outcomes: list[tuple[Job, Outcome]] = []
        start = 0
        for job in jobs:
            outcomes.append((job, embeddings[start : start + len(job.texts)]))
            start += len(job.texts)
        return outcomes
