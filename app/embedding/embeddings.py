"""The embedder as the service runs it: `EmbeddingService` (the model's load and warm-up, and
the scheduler) and `EmbeddingMemo` (recent vectors) in front of it."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from opentelemetry.trace import Tracer

from app.core.states import EmbedderState, Precision
from app.embedding.onnx_embedder import WARM_UP_TEXT, ModelError, OnnxEmbedder
from app.embedding.scheduler import RunScheduler
from app.embedding.types import (
    EmbedderUnavailableError,
    Embedding,
    Outcome,
    OverloadedError,
    RunnerGoneError,
)

log = logging.getLogger(__name__)

EmbedderFactory = Callable[[], OnnxEmbedder]

#: Runs through the queue that end the start-up (after the first answer, or before a preloaded
#: service reports itself ready): the first request is then not the first to wake a worker.
WARM_UP_REQUESTS = 3


class Embedder(Protocol):
    async def embed(self, texts: Sequence[str]) -> list[Embedding]: ...


class EmbeddingMemo:
    """Vectors by the SHA-256 of the exact text (the model is deterministic for a text), at most
    `capacity` (the least recently used go first; 0 turns it off); requests that ask for the
    same new text at the same time share one run (docs/decisions/embedding-memo.md)."""

    def __init__(self, embeddings: Embedder, capacity: int) -> None:
        self._embeddings = embeddings
        self._capacity = capacity
        #: Texts found in the memo, and texts not (read by /metrics).
        self.hits_total = 0
        self.misses_total = 0
        self._memo: OrderedDict[bytes, Embedding] = OrderedDict()
        #: Texts being embedded now, for requests that ask for them meanwhile.
        self._running: dict[bytes, asyncio.Future[Embedding]] = {}

    def __len__(self) -> int:
        return len(self._memo)

    async def embed(self, texts: Sequence[str]) -> list[Embedding]:
        if self._capacity == 0:
            return await self._embeddings.embed(texts)
        digests: list[bytes] = []
        found: dict[bytes, Embedding] = {}
        missing: dict[bytes, str] = {}
        waiting: dict[bytes, tuple[str, asyncio.Future[Embedding]]] = {}
        for text in texts:
            digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
            digests.append(digest)
            hit = self._memo.get(digest)
            if hit is not None:
                self._memo.move_to_end(digest)
                found[digest] = hit
            elif digest in self._running:
                waiting[digest] = (text, self._running[digest])
            else:
                missing.setdefault(digest, text)
        self.hits_total += len(texts) - len(missing)
        self.misses_total += len(missing)
        if missing:
            loop = asyncio.get_running_loop()
            futures: dict[bytes, asyncio.Future[Embedding]] = {}
            for digest in missing:
                futures[digest] = self._running[digest] = loop.create_future()
            try:
                fresh = await self._embeddings.embed(list(missing.values()))
            except BaseException as exc:
                # Those waiting get this run's error, or run themselves if this request is gone.
                shared = exc if isinstance(exc, Exception) else RunnerGoneError()
                for future in futures.values():
                    future.set_exception(shared)
                    future.exception()  # retrieved: nobody may be waiting, and that is fine
                raise
            finally:
                for digest in futures:
                    self._running.pop(digest, None)
            for digest, embedding in zip(missing, fresh, strict=True):
                futures[digest].set_result(embedding)
                found[digest] = self._memo[digest] = embedding
                self._memo.move_to_end(digest)
            while len(self._memo) > self._capacity:
                self._memo.popitem(last=False)
        for digest, (text, future) in waiting.items():
            try:
                found[digest] = await asyncio.shield(future)
            except RunnerGoneError:
                (found[digest],) = await self.embed([text])
        return list(map(found.__getitem__, digests))


class EmbeddingService:
    """The model's lazy load, the warm-up after the first answer (or before readiness), and
    the scheduler (scheduler.py: the queue and the worker threads) behind one small API."""

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
    ) -> None:
        self.model_name = model_name
        #: Set (app/main.py) when traces are exported: the queue's wait and the model's run.
        self.tracer: Tracer | None = None
        #: How the model's file stores its weights (int8 for the packaged model), when known.
        self.weights = weights
        self.precision = precision
        #: With KP_EMBEDDER_PRECISION=int8: which int8 products run, or why float32 instead.
        self.precision_reason = precision_reason
        #: The queue and the workers (their figures: queue_depth, idle_workers, runs_total).
        self.scheduler = RunScheduler(
            self._run_model,
            workers=workers,
            batch_size=batch_size,
            queue_limit=queue_limit,
            max_wait_ms=max_wait_ms,
        )
        self._factory = factory
        self.state = EmbedderState.DISABLED if factory is None else EmbedderState.NOT_LOADED
        self.reason: str | None = "disabled by KP_EMBEDDER=none" if factory is None else None
        self.embedder: OnnxEmbedder | None = None
        self.closing = False
        self._load_task: asyncio.Task[None] | None = None
        self.warm_up_task: asyncio.Task[None] | None = None

    @property
    def loaded_fully(self) -> bool:
        """Loaded, and nothing of the start-up is left to do."""
        task = self.warm_up_task
        return task is not None and task.done() and self.state is EmbedderState.READY

    @property
    def degraded(self) -> bool:
        return self.state in (EmbedderState.DISABLED, EmbedderState.UNAVAILABLE)

    async def load(self) -> None:
        """Loads the model once (the least the first request needs; the rest of the start-up
        follows the first answer); concurrent callers wait for the same load."""
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
        except Exception as exc:  # ModelError says what; onnxruntime raises many other types
            why = str(exc) if isinstance(exc, ModelError) else f"{type(exc).__name__}: {exc}"
            self.mark_unavailable(why)
            return
        if not self.scheduler.start():
            return  # closing: stay as is
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

    async def preload(self) -> None:
        """Load and warm up before the first request (KP_EMBEDDER_PRELOAD): nobody waits yet."""
        await self.load()
        await asyncio.shield(self.warm_up())

    def warm_up(self) -> asyncio.Task[None]:
        """The warm-up, started once: after the first answer, or by preload."""
        if self.warm_up_task is None:
            self.warm_up_task = asyncio.create_task(self._warm_up())
        return self.warm_up_task

    async def _warm_up(self) -> None:
        """What later runs need, kept out of the first request's way: finish_loading, then
        WARM_UP_REQUESTS runs through the queue."""
        embedder = self.embedder
        if embedder is None or self.state is not EmbedderState.READY:
            return
        try:
            await asyncio.to_thread(embedder.finish_loading)
            for _ in range(WARM_UP_REQUESTS):
                await self._queued([WARM_UP_TEXT])
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
        """Stops the workers after their current run (requests still waiting fail), and waits
        for the load and warm-up under way."""
        self.closing = True
        self.scheduler.close()
        for task in (self._load_task, self.warm_up_task):
            if task is not None:
                await asyncio.gather(task, return_exceptions=True)
        await asyncio.to_thread(self.scheduler.join)

    async def embed(self, texts: Sequence[str]) -> list[Embedding]:
        """Embeddings in the order of `texts`, or EmbedderUnavailableError / OverloadedError."""
        if self.state is not EmbedderState.READY:
            await self.load()  # changes the state
            state: EmbedderState = self.state
            if state is not EmbedderState.READY:
                raise EmbedderUnavailableError(self.reason or state.value)
        try:
            return await self._queued(texts)
        finally:
            # The first answer is on its way: warm up now.
            if self.warm_up_task is None and not self.closing:
                self.warm_up()

    def _run_model(self, texts: list[str], one_core: bool = False) -> list[Embedding]:
        """One model run (on a worker thread) over the loaded model."""
        if self.embedder is None:
            raise RuntimeError("the model is not loaded")
        return self.embedder.embed_grouped(
            texts, one_core=one_core, max_group=self.scheduler.batch_size
        )

    async def _queued(self, texts: Sequence[str]) -> list[Embedding]:
        """Through the queue and a worker, as every request goes."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Embedding]] = loop.create_future()

        def settle(outcome: Outcome) -> None:  # on a worker thread
            # A closed loop raises RuntimeError: nobody is waiting any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_set_outcome, future, outcome)

        job = self.scheduler.submit(texts, settle, future.done)
        embeddings = await future
        if self.tracer is not None and job.run_started is not None and job.run_ended is not None:
            # Timed on the worker: spans of the past, under the request's current span.
            wall_ns = time.time_ns() - time.monotonic_ns()
            queued, started, ended = (
                wall_ns + round(t * 1e9) for t in (job.queued_at, job.run_started, job.run_ended)
            )
            attributes = {"kp.texts": len(texts)}
            for name, begin, end in (("queue", queued, started), ("run", started, ended)):
                span = self.tracer.start_span(
                    f"kp.model.{name}", start_time=begin, attributes=attributes
                )
                span.end(end_time=end)
        return embeddings

    def _log_extra(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "weights": self.weights,
            "precision": self.precision,
            "precision_reason": self.precision_reason,
            "workers": self.scheduler.workers,
            "runs": dict(self.scheduler.runs_total),
        }


def _set_outcome(future: asyncio.Future[list[Embedding]], outcome: Outcome) -> None:
    if future.done():  # the client went away
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
