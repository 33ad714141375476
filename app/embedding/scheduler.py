"""The worker threads that run the model, and the choice of each one's next run.

Each worker takes its next run from the queue as soon as it is free, without a round trip
through the event loop (busy with HTTP under load, it would leave the cores idle between runs):

- a request alone (nothing else waiting, every worker idle) gets one run over all cores, the
  lowest latency one text can have;
- under load each free worker takes a share of the queue and runs it on one core: runs side by
  side do more per second than runs one after another over all cores. No request ever waits
  for others to arrive.

A run that fails is retried one request at a time, so one bad input fails alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from app.embedding.admission import Admission
from app.embedding.queue import Job, JobQueue
from app.embedding.types import (
    EmbedderUnavailableError,
    Embedding,
    EmbedObserver,
    NoObserver,
    Outcome,
)

log = logging.getLogger(__name__)

#: Texts one one-core run takes at most while other workers run too: a worker's requests all
#: wait for its run, so a share stays small.
ONE_CORE_RUN_TEXTS: Final = 2

#: One model run over `texts` (on all cores, or on one): what the scheduler calls on a worker.
Backend = Callable[[list[str], bool], list[Embedding]]
Cores = Literal["all_cores", "one_core"]


@dataclass(frozen=True, slots=True)
class Run:
    jobs: list[Job]
    one_core: bool
    width: int  # workers it occupies: all of them for a run over every core

    @property
    def count(self) -> int:
        """Texts in the run."""
        return sum(len(job.texts) for job in self.jobs)


class RunScheduler:
    """The queue, its admission and the workers, under one lock (a worker's choice depends on
    both the queue and which workers are idle). `backend` is public: the seam tests wrap."""

    def __init__(
        self,
        backend: Backend,
        *,
        workers: int = 1,
        batch_size: int = 32,
        admission: Admission | None = None,
        observer: EmbedObserver | None = None,
    ) -> None:
        self.backend = backend
        self.workers = workers
        self.batch_size = batch_size
        self.admission = admission or Admission()
        self.observer: EmbedObserver = observer or NoObserver()
        self._lock = threading.Condition()
        self._queue = JobQueue()
        self._running_texts = 0
        self._idle_workers = workers
        self._closing = False
        self._threads: list[threading.Thread] = []
        #: Model calls made, on every core (a request alone) and on one core (side by side).
        self.runs_total: dict[Cores, int] = {"all_cores": 0, "one_core": 0}

    @property
    def queue_depth(self) -> int:
        """Texts waiting for the model or in it."""
        return self._queue.texts + self._running_texts

    @property
    def idle_workers(self) -> int:
        """Workers not running the model now (a run over every core takes them all)."""
        return self._idle_workers

    @property
    def closing(self) -> bool:
        return self._closing

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
        abandoned: Callable[[], bool] | None = None,
    ) -> None:
        """Queues `texts`; `settle` gets their outcome from a worker. Raises OverloadedError
        at the door, EmbedderUnavailableError once closing."""
        job = Job(texts, settle) if abandoned is None else Job(texts, settle, abandoned)
        with self._lock:
            if self._closing:
                raise EmbedderUnavailableError("the service is shutting down")
            self.admission.check_door(self.queue_depth, len(texts))
            self._queue.put(job)
            self._lock.notify()

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
                self.observer.queue_waited(started - job.queued_at)
            outcomes = self._run_jobs(run.jobs, one_core=run.one_core)
            with self._lock:
                self._running_texts -= run.count
                self._idle_workers += run.width
                self._lock.notify_all()
            # Only now: a client answered at once sends its next request at once, and the door
            # must not count this run as still going (a needless 503 at one client).
            for job, outcome in outcomes:
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
        if self._idle_workers == self.workers and len(self._queue) == 1:
            run = Run(self._queue.take(1), one_core=False, width=self.workers)
        elif self.workers == 1:
            run = Run(self._queue.take(self.batch_size), one_core=False, width=1)
        else:
            # A share small enough to be one model run: a worker's jobs all wait for it.
            share = -(-self._queue.texts // self._idle_workers)  # rounded up
            jobs = self._queue.take(min(share, ONE_CORE_RUN_TEXTS))
            run = Run(jobs, one_core=True, width=1)
        self._running_texts += run.count
        self._idle_workers -= run.width
        return run

    def _shed_stale(self) -> None:
        """Under the lock: drops the jobs at the head that nobody awaits any more, and turns
        away those that waited past the limit (the guarantee that the queue never piles up)."""
        now = time.monotonic()
        errors: dict[int, Exception] = {}

        def stale(job: Job) -> bool:
            error = self.admission.expired(now - job.queued_at)
            if error is not None:
                errors[id(job)] = error
            return error is not None or job.abandoned()

        for job in self._queue.pop_stale(stale):
            if id(job) in errors:
                job.settle(errors[id(job)])

    def _run_jobs(self, jobs: list[Job], *, one_core: bool) -> list[tuple[Job, Outcome]]:
        """One model run for all jobs; if it fails, each job alone."""
        texts = [text for job in jobs for text in job.texts]
        started = time.monotonic()
        try:
            embeddings = self.backend(texts, one_core)
        except Exception as exc:
            if len(jobs) > 1:
                return [out for job in jobs for out in self._run_jobs([job], one_core=one_core)]
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
