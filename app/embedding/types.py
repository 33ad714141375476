"""What the embedding service's parts share: its answers, its two errors, and the observer
that is told how long requests wait and runs take (metrics, without a prometheus import here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from app.core.errors import PartError, ServiceError
from app.core.states import EmbedderFailure, OverloadReason


@dataclass(frozen=True, slots=True)
class Embedding:
    vector: npt.NDArray[np.float32]
    token_count: int
    truncated: bool


#: What a request gets back from the model: its vectors, or why there are none.
Outcome = list[Embedding] | BaseException


class EmbedderUnavailableError(PartError):
    """No embedding can be had for these texts; novelty falls back to 0.5."""

    def __init__(self, detail: str, code: EmbedderFailure = "embedder_unavailable") -> None:
        super().__init__(detail)
        self.code = code


class RunnerGoneError(PartError):
    """The request whose run a text waited for went away: embed it anew."""


class OverloadedError(ServiceError):
    """Too many texts are waiting for the model; `reason` says which guard turned it away.
    Nothing changed: the client may retry after a second."""

    def __init__(self, detail: str, reason: OverloadReason) -> None:
        super().__init__(
            503, "overloaded", f"overloaded, try again shortly: {detail}", retry_after=1
        )
        self.reason = reason


class EmbedObserver(Protocol):
    """Told from the worker threads (so thread-safe and quick) that a request's run starts,
    `seconds` after it entered the queue, and that a model run (every text of one or more
    requests) took `seconds`."""

    def queue_waited(self, seconds: float) -> None: ...

    def model_ran(self, seconds: float) -> None: ...
