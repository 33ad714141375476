"""The queue of requests waiting for the model, and how a run's share of it is chosen.

Not thread-safe on its own: the scheduler holds its lock around every call.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from app.services.embeddings_types import Outcome

#: About the characters of English text that fill the 512-token window.
WINDOW_CHARS: Final = 3000
#: Requests whose longest texts are within this ratio of each other share a one-core run:
#: their texts pad each other little.
SIMILAR_RATIO: Final = 1.15
#: ... give or take this many characters, so that short texts (where 15% is one or two
#: characters) still find company.
SIMILAR_SLACK_CHARS: Final = 8


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

    @property
    def chars(self) -> int:
        """Length of the longest text, up to what fills the window: a cheap stand-in for the
        tokens the model reads (a megabyte and a full window cost the same run)."""
        return min(WINDOW_CHARS, max((len(t) for t in self.texts), default=0))


def similar(a: int, b: int) -> bool:
    """Whether requests whose longest texts have `a` and `b` characters may share a run."""
    return a / SIMILAR_RATIO - SIMILAR_SLACK_CHARS <= b <= a * SIMILAR_RATIO + SIMILAR_SLACK_CHARS


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

    def take(self, max_texts: int, *, similar_only: bool = False) -> list[Job]:
        """The oldest job and, up to `max_texts` texts, more: the next in order, or with
        `similar_only` any of similar length."""
        first = self._remove_first()
        jobs, size = [first], len(first.texts)
        for job in list(self._jobs):
            if size + len(job.texts) > max_texts:
                if similar_only:
                    continue
                break
            if similar_only and not similar(first.chars, job.chars):
                continue
            self._jobs.remove(job)
            self.texts -= len(job.texts)
            jobs.append(job)
            size += len(job.texts)
        return jobs

    def _remove_first(self) -> Job:
        job = self._jobs.popleft()
        self.texts -= len(job.texts)
        return job
