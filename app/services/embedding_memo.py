"""One model run per text: a bounded memo of recent vectors, by the SHA-256 of the exact text
handed to the model. A commit after a dry run, or a retry, gets the vector the model gave
the first time (the model is deterministic for a text, so the answer is the same) without
running it again."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from app.core.metrics import Metrics
from app.services.embeddings import Embedding


class Embedder(Protocol):
    async def embed(self, texts: Sequence[str]) -> list[Embedding]: ...


class EmbeddingMemo:
    """`capacity` vectors at most (the least recently used go first); 0 turns it off."""

    def __init__(self, embeddings: Embedder, capacity: int, metrics: Metrics | None = None):
        self._embeddings = embeddings
        self._capacity = capacity
        self._metrics = metrics
        self._memo: OrderedDict[bytes, Embedding] = OrderedDict()

    def __len__(self) -> int:
        return len(self._memo)

    async def embed(self, texts: Sequence[str]) -> list[Embedding]:
        if self._capacity == 0:
            return await self._embeddings.embed(texts)
        digests = [hashlib.sha256(t.encode("utf-8", "surrogatepass")).digest() for t in texts]
        found: dict[bytes, Embedding] = {}
        missing: dict[bytes, str] = {}
        for digest, text in zip(digests, texts, strict=True):
            hit = self._memo.get(digest)
            if hit is not None:
                self._memo.move_to_end(digest)
                found[digest] = hit
            else:
                missing.setdefault(digest, text)
        if self._metrics is not None:
            self._metrics.embed_memo.labels("hit").inc(len(texts) - len(missing))
            self._metrics.embed_memo.labels("miss").inc(len(missing))
        if missing:
            fresh = await self._embeddings.embed(list(missing.values()))
            for digest, embedding in zip(missing, fresh, strict=True):
                found[digest] = embedding
                self._memo[digest] = embedding
                self._memo.move_to_end(digest)
            while len(self._memo) > self._capacity:
                self._memo.popitem(last=False)
        return [found[d] for d in digests]
