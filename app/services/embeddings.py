"""The embedder as the service runs it: loaded once, lazily, and fed by one batching task.

Requests put their texts on a queue; one task takes everything waiting (up to a batch size),
tokenizes and embeds it on a worker thread, and answers each request. While the model runs,
new requests gather, so concurrent requests share model runs without any added wait. Texts of
similar length share a run, which keeps padding small (and padding does not change a vector:
the attention mask hides it and the pooling ignores it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

import numpy as np
import numpy.typing as npt

from app.embedding.onnx_embedder import ModelError, OnnxEmbedder, TokenizedText

log = logging.getLogger(__name__)


class EmbedderState(StrEnum):
    DISABLED = "disabled"
    NOT_LOADED = "not_loaded"
    LOADING = "loading"
    READY = "ready"
    UNAVAILABLE = "unavailable"


class EmbedderUnavailableError(Exception):
    """No embedding can be had for these texts; novelty falls back to 0.5."""

    def __init__(
        self,
        detail: str,
        code: Literal["embedder_unavailable", "embedding_failed"] = "embedder_unavailable",
    ) -> None:
        super().__init__(detail)
        self.code = code


class OverloadedError(Exception):
    """Too many texts are waiting for the model."""


@dataclass(frozen=True, slots=True)
class Embedding:
    vector: npt.NDArray[np.float32]
    token_count: int
    truncated: bool


@dataclass(slots=True)
class _Job:
    texts: Sequence[str]
    future: asyncio.Future[list[Embedding]] = field(repr=False)


EmbedderFactory = Callable[[], OnnxEmbedder]


class EmbeddingService:
    """Owns the embedder's life cycle (state, reason) and the queue in front of it."""

    def __init__(
        self,
        factory: EmbedderFactory | None,
        *,
        model_name: str | None,
        batch_size: int = 32,
        queue_limit: int = 256,
    ) -> None:
        self._factory = factory
        self.model_name = model_name
        self.state = EmbedderState.DISABLED if factory is None else EmbedderState.NOT_LOADED
        self.reason: str | None = "disabled by KP_EMBEDDER=none" if factory is None else None
        self._batch_size = batch_size
        self._queue_limit = queue_limit
        self._embedder: OnnxEmbedder | None = None
        self._load_task: asyncio.Task[None] | None = None
        # One thread runs the model: onnxruntime parallelises each run over the cores itself.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedder")
        self._queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._pending_texts = 0
        self._worker: asyncio.Task[None] | None = None
        self.batches_total = 0

    @property
    def queue_depth(self) -> int:
        return self._pending_texts

    @property
    def degraded(self) -> bool:
        return self.state in (EmbedderState.DISABLED, EmbedderState.UNAVAILABLE)

    # ── life cycle ──────────────────────────────────────────────────────────

    async def load(self) -> None:
        """Load the model once; concurrent callers wait for the same load."""
        if self._factory is None or self.state in (EmbedderState.READY, EmbedderState.UNAVAILABLE):
            return
        if self._load_task is None:
            self._load_task = asyncio.create_task(self._load())
        await asyncio.shield(self._load_task)

    async def _load(self) -> None:
        assert self._factory is not None
        self.state = EmbedderState.LOADING
        log.info("embedder loading", extra={"model": self.model_name})
        loop = asyncio.get_running_loop()
        try:
            self._embedder = await loop.run_in_executor(self._executor, self._factory)
        except ModelError as exc:
            self.mark_unavailable(str(exc))
            return
        except Exception as exc:  # onnxruntime raises many types for a bad file
            self.mark_unavailable(f"{type(exc).__name__}: {exc}")
            return
        self.state = EmbedderState.READY
        self._worker = asyncio.create_task(self._run_batches(), name="embedding-batcher")
        log.info("embedder ready", extra={"model": self.model_name})

    def mark_unavailable(self, reason: str) -> None:
        self.state = EmbedderState.UNAVAILABLE
        self.reason = reason
        log.error("embedder unavailable; novelty is not measured", extra={"reason": reason})

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        self._executor.shutdown(wait=True, cancel_futures=True)

    # ── embedding ───────────────────────────────────────────────────────────

    async def embed(self, texts: Sequence[str]) -> list[Embedding]:
        """Embeddings in the order of `texts`, or EmbedderUnavailableError / OverloadedError."""
        await self.load()
        if self.state is not EmbedderState.READY:
            raise EmbedderUnavailableError(self.reason or self.state.value)
        if self._pending_texts + len(texts) > self._queue_limit and self._pending_texts:
            raise OverloadedError(f"{self._pending_texts} texts are waiting for the model")
        future: asyncio.Future[list[Embedding]] = asyncio.get_running_loop().create_future()
        self._pending_texts += len(texts)
        self._queue.put_nowait(_Job(texts, future))
        return await future

    async def _run_batches(self) -> None:
        while True:
            jobs = [await self._queue.get()]
            size = len(jobs[0].texts)
            while size < self._batch_size and not self._queue.empty():
                job = self._queue.get_nowait()
                jobs.append(job)
                size += len(job.texts)
            try:
                await self._run_jobs(jobs)
            finally:
                self._pending_texts -= size

    async def _run_jobs(self, jobs: list[_Job]) -> None:
        """One model run for all jobs; if it fails, each job alone, so one bad input fails alone."""
        texts = [text for job in jobs for text in job.texts]
        loop = asyncio.get_running_loop()
        try:
            embeddings = await loop.run_in_executor(self._executor, self._embed_now, texts)
        except Exception as exc:
            if len(jobs) > 1:
                for job in jobs:
                    await self._run_jobs([job])
                return
            log.exception("embedding failed for one request", extra={"texts": len(texts)})
            failure = EmbedderUnavailableError(
                f"embedding failed: {type(exc).__name__}", "embedding_failed"
            )
            if not jobs[0].future.done():
                jobs[0].future.set_exception(failure)
            return
        self.batches_total += 1
        start = 0
        for job in jobs:
            if not job.future.done():  # the client may have gone away
                job.future.set_result(embeddings[start : start + len(job.texts)])
            start += len(job.texts)

    def _embed_now(self, texts: list[str]) -> list[Embedding]:
        """Runs on the worker thread: tokenize, group by length, run the model per group."""
        assert self._embedder is not None
        tokenized = self._embedder.tokenize(texts)
        vectors: list[npt.NDArray[np.float32] | None] = [None] * len(texts)
        for group in length_groups(tokenized, self._batch_size):
            rows = self._embedder.embed_tokenized([tokenized[i] for i in group])
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
