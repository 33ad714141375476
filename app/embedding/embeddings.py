"""The embedder as the service runs it: loaded once, lazily, run by its own worker threads.

This facade puts four parts together, each readable and testable alone:

- embeddings_lifecycle: the model's state, lazy load and warm-up;
- embeddings_admission: the two limits that turn real overload away (OverloadedError);
- embeddings_queue: the requests waiting, and which of them share a run;
- embeddings_scheduler: the worker threads, their runs, one-at-a-time retries and shutdown,
  calling embeddings_backend (tokenize, group by token length, run the model).

Load the machine can carry is served later, not refused, on a fast CPU and a slow one alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from app.core.states import EmbedderState, Precision
from app.embedding.admission import Admission
from app.embedding.backend import ModelBackend, length_groups
from app.embedding.lifecycle import EmbedderFactory, ModelLifecycle
from app.embedding.onnx_embedder import WARM_UP_TEXT
from app.embedding.scheduler import RunScheduler
from app.embedding.types import (
    EmbedderUnavailableError,
    Embedding,
    EmbedObserver,
    Outcome,
    OverloadedError,
)

__all__ = [
    "EmbedObserver",
    "EmbedderFactory",
    "EmbedderUnavailableError",
    "Embedding",
    "EmbeddingService",
    "Outcome",
    "OverloadedError",
    "length_groups",
]

log = logging.getLogger(__name__)

#: Runs through the queue that end the start-up (after the first answer, or before a preloaded
#: service reports itself ready): the first request is then not the first to wake a worker.
WARM_UP_REQUESTS = 3


class EmbeddingService:
    """The embedder's life cycle, queue and workers behind one small API (embed, load,
    preload, close, and the figures /readyz and /metrics read)."""

    def __init__(
        self,
        factory: EmbedderFactory | None,
        *,
        model_name: str | None,
        weights: str | None = None,
        precision: Precision | None = None,
        precision_reason: str | None = None,
        workers: int = 1,
        batch_size: int = 32,
        queue_limit: int = 256,
        max_wait_ms: float = 10_000.0,
        observer: EmbedObserver | None = None,
    ) -> None:
        self.model_name = model_name
        #: How the model's file stores its weights (int8 for the packaged model), when known.
        self.weights = weights
        self.precision = precision
        #: With KP_EMBEDDER_PRECISION=int8: which int8 products run, or why float32 instead.
        self.precision_reason = precision_reason
        self.workers = workers
        self.scheduler = RunScheduler(
            ModelBackend(lambda: self.lifecycle.embedder, batch_size),
            workers=workers,
            batch_size=batch_size,
            admission=Admission(queue_limit, max_wait_ms),
            observer=observer,
        )
        self.lifecycle = ModelLifecycle(
            factory,
            on_loaded=self.scheduler.start,
            warm_runs=self._warm_runs,
            log_extra=self._log_extra,
        )

    def observe(self, observer: EmbedObserver) -> None:
        """Where queue waits and model run times go (the metrics)."""
        self.scheduler.observer = observer

    @property
    def state(self) -> EmbedderState:
        return self.lifecycle.state

    @property
    def reason(self) -> str | None:
        return self.lifecycle.reason

    @property
    def runs_total(self) -> dict[str, int]:
        """Model calls made, on every core (a request alone) and on one core (side by side)."""
        return {cores: runs for cores, runs in self.scheduler.runs_total.items()}

    @property
    def queue_depth(self) -> int:
        """Texts waiting for the model or in it."""
        return self.scheduler.queue_depth

    @property
    def idle_workers(self) -> int:
        return self.scheduler.idle_workers

    @property
    def loaded_fully(self) -> bool:
        """The model is loaded and nothing of its start-up is left to do."""
        return self.lifecycle.warmed_up

    @property
    def degraded(self) -> bool:
        return self.state in (EmbedderState.DISABLED, EmbedderState.UNAVAILABLE)

    async def load(self) -> None:
        """Load the model once; the rest of the start-up follows the first answer."""
        await self.lifecycle.load()

    async def preload(self) -> None:
        """Load and warm up before the first request (KP_EMBEDDER_PRELOAD): nobody waits yet."""
        await self.lifecycle.load()
        await asyncio.shield(self.lifecycle.warm_up())

    def mark_unavailable(self, reason: str) -> None:
        self.lifecycle.mark_unavailable(reason)

    async def close(self) -> None:
        """Stops the workers after their current run; requests still waiting fail."""
        self.lifecycle.closing = True
        self.scheduler.close()
        await self.lifecycle.close()
        await asyncio.to_thread(self.scheduler.join)

    async def embed(self, texts: Sequence[str]) -> list[Embedding]:
        """Embeddings in the order of `texts`, or EmbedderUnavailableError / OverloadedError."""
        await self.lifecycle.load()
        if self.state is not EmbedderState.READY:
            raise EmbedderUnavailableError(self.reason or self.state.value)
        try:
            return await self._queued(texts)
        finally:
            if not self.lifecycle.closing:  # the first answer is on its way: warm up now
                self.lifecycle.warm_up()

    async def _queued(self, texts: Sequence[str]) -> list[Embedding]:
        """Through the queue and a worker, as every request goes."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Embedding]] = loop.create_future()

        def settle(outcome: Outcome) -> None:  # on a worker thread
            # A closed loop raises RuntimeError: nobody is waiting any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_set_outcome, future, outcome)

        self.scheduler.submit(texts, settle, future.done)
        return await future

    async def _warm_runs(self) -> None:
        for _ in range(WARM_UP_REQUESTS):
            await self._queued([WARM_UP_TEXT])

    def _log_extra(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "weights": self.weights,
            "precision": self.precision,
            "precision_reason": self.precision_reason,
            "workers": self.workers,
            "runs": self.runs_total,
        }


def _set_outcome(future: asyncio.Future[list[Embedding]], outcome: Outcome) -> None:
    if future.done():  # the client went away
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
