"""The queue of requests waiting for the model, taken in arrival order.

Not thread-safe on its own: the scheduler holds its lock around every call.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from app.embedding.types import Outcome


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
            stale.append(self._remove_first())
        return stale

    def take(self, max_texts: int) -> list[Job]:
        """The oldest job and the next ones in order, up to `max_texts` texts (the model run
        groups their texts by length: embeddings_backend)."""
        jobs = [self._remove_first()]
        size = len(jobs[0].texts)
        while self._jobs and size + len(self._jobs[0].texts) <= max_texts:
            job = self._remove_first()
            jobs.append(job)
            size += len(job.texts)
        return jobs

    def _remove_first(self) -> Job:
        job = self._jobs.popleft()
        self.texts -= len(job.texts)
        return job
