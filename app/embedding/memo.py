"""One model run per text: a bounded memo of recent vectors, by the SHA-256 of the exact text
handed to the model. A commit after a dry run, or a retry, gets the vector the model gave
the first time (the model is deterministic for a text, so the answer is the same) without
running it again; requests that ask for the same new text at the same time share one run."""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from app.core.errors import PartError
from app.embedding.embeddings import Embedding


class Embedder(Protocol):
    async def embed(self, texts: Sequence[str]) -> list[Embedding]: ...


class _RunnerGoneError(PartError):
    """The request whose run a text waited for went away: embed it anew."""


class EmbeddingMemo:
    """`capacity` vectors at most (the least recently used go first); 0 turns it off."""

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
        digests = [hashlib.sha256(t.encode("utf-8", "surrogatepass")).digest() for t in texts]
        found: dict[bytes, Embedding] = {}
        missing: dict[bytes, str] = {}
        waiting: dict[bytes, tuple[str, asyncio.Future[Embedding]]] = {}
        for digest, text in zip(digests, texts, strict=True):
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
            found |= await self._run(missing)
        for digest, (text, future) in waiting.items():
            try:
                found[digest] = await asyncio.shield(future)
            except _RunnerGoneError:
                (found[digest],) = await self.embed([text])
        return [found[d] for d in digests]

    async def _run(self, missing: dict[bytes, str]) -> dict[bytes, Embedding]:
        loop = asyncio.get_running_loop()
        futures = {digest: loop.create_future() for digest in missing}
        self._running.update(futures)
        try:
            fresh = await self._embeddings.embed(list(missing.values()))
        except BaseException as exc:
            # Those waiting get this run's error, or run themselves if this request is gone.
            shared = exc if isinstance(exc, Exception) else _RunnerGoneError()
            for future in futures.values():
                future.set_exception(shared)
                future.exception()  # retrieved: nobody may be waiting, and that is fine
            raise
        finally:
            for digest in futures:
                self._running.pop(digest, None)
        done = dict(zip(missing, fresh, strict=True))
        for digest, embedding in done.items():
            futures[digest].set_result(embedding)
            self._memo[digest] = embedding
            self._memo.move_to_end(digest)
        while len(self._memo) > self._capacity:
            self._memo.popitem(last=False)
        return done
