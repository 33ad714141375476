"""The model's life cycle: its state, the lazy load (once, shared by concurrent callers) and
the warm-up that follows the first answer (or precedes readiness, with preload)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from app.core.states import EmbedderState
from app.embedding.onnx_embedder import ModelError, OnnxEmbedder
from app.embedding.types import EmbedderUnavailableError, OverloadedError

log = logging.getLogger(__name__)

EmbedderFactory = Callable[[], OnnxEmbedder]


class ModelLifecycle:
    """`on_loaded` starts what runs the model (False: closing, stay as is); `warm_runs` sends
    a few runs the way requests go."""

    def __init__(
        self,
        factory: EmbedderFactory | None,
        *,
        on_loaded: Callable[[], bool],
        warm_runs: Callable[[], Awaitable[None]],
        log_extra: Callable[[], dict[str, Any]] = dict,
    ) -> None:
        self._factory = factory
        self._on_loaded = on_loaded
        self._warm_runs = warm_runs
        self._log_extra = log_extra
        self.state = EmbedderState.DISABLED if factory is None else EmbedderState.NOT_LOADED
        self.reason: str | None = "disabled by KP_EMBEDDER=none" if factory is None else None
        self.embedder: OnnxEmbedder | None = None
        self.closing = False
        self._load_task: asyncio.Task[None] | None = None
        self._warm_up_task: asyncio.Task[None] | None = None

    @property
    def warmed_up(self) -> bool:
        """Loaded, and nothing of the start-up is left to do."""
        task = self._warm_up_task
        return task is not None and task.done() and self.state is EmbedderState.READY

    async def load(self) -> None:
        """Loads the model once (the least the first request needs); concurrent callers wait
        for the same load."""
        if self._factory is None or self.state in (EmbedderState.READY, EmbedderState.UNAVAILABLE):
            return
        if self._load_task is None:
            self._load_task = asyncio.create_task(self._load(self._factory))
        await asyncio.shield(self._load_task)

    async def _load(self, factory: EmbedderFactory) -> None:
        self.state = EmbedderState.LOADING
        log.info("embedder loading", extra=self._log_extra())
        try:
            self.embedder = await asyncio.to_thread(factory)
        except ModelError as exc:
            self.mark_unavailable(str(exc))
            return
        except Exception as exc:  # onnxruntime raises many types for a bad file
            self.mark_unavailable(f"{type(exc).__name__}: {exc}")
            return
        if not self._on_loaded():
            return
        self.state = EmbedderState.READY
        cache = self.embedder.cache_outcome
        if cache is not None and cache.detail is not None:
            # The start was as slow as without a cache, or the next one will be.
            log.warning(
                "model cache: the graph was optimised at this start"
                + (", not saved" if cache.state == "unsaved" else ", saved"),
                extra={"reason": cache.detail},
            )
        log.info(
            "embedder ready",
            extra={**self._log_extra(), "model_cache": None if cache is None else cache.state},
        )

    def warm_up(self) -> asyncio.Task[None]:
        """The warm-up, started once: after the first answer, or by preload."""
        if self._warm_up_task is None:
            self._warm_up_task = asyncio.create_task(self._warm_up())
        return self._warm_up_task

    async def _warm_up(self) -> None:
        """What later runs need, kept out of the first request's way: the one-core session,
        each session's first run, and a few runs through the queue (so that the first request
        is not the first to wake a worker)."""
        embedder = self.embedder
        if embedder is None or self.state is not EmbedderState.READY:
            return
        try:
            await asyncio.to_thread(embedder.finish_loading)
            await self._warm_runs()
        except OverloadedError:
            pass  # turned away under a tiny queue limit: the service is busy, hence warm
        except EmbedderUnavailableError as exc:
            if not self.closing:
                self.mark_unavailable(f"warm-up run failed: {exc}")
        except Exception as exc:  # the model ran for a request, yet cannot run here
            self.mark_unavailable(f"warm-up run failed: {type(exc).__name__}: {exc}")
        else:
            log.info("embedder warmed up", extra=self._log_extra())

    def mark_unavailable(self, reason: str) -> None:
        self.state = EmbedderState.UNAVAILABLE
        self.reason = reason
        log.error("embedder unavailable; novelty is not measured", extra={"reason": reason})

    async def close(self) -> None:
        """Marks closing and waits for the load and warm-up under way."""
        self.closing = True
        for task in (self._load_task, self._warm_up_task):
            if task is not None:
                await asyncio.gather(task, return_exceptions=True)
