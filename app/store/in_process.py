"""The default novelty memory: a VectorCache in this process (no Redis needed)."""

from __future__ import annotations

from collections.abc import Sequence

from app.core.health import Health
from app.domain.vector_cache import CacheStats, VectorCache
from app.store.base import BackendInfo, Comparison, Vector


def compare_in_order(
    cache: VectorCache, vectors: Sequence[Vector], *, add: bool
) -> list[Comparison]:
    """Each vector against `cache`, then added to it when `add`. Without `add` (a dry run)
    several vectors still see the ones before them, on a copy that is dropped afterwards."""
    if not add and len(vectors) > 1:
        cache, add = cache.copy(), True
    results = []
    for vector in vectors:
        size = cache.size
        best = cache.max_cosine_similarity(vector) if size else None
        results.append(Comparison(best, size))
        if add:
            cache.add(vector)
    return results


class InProcessMemory:
    """The cache of one process. `compare` never awaits: on the event loop each call is one
    step, so concurrent requests meet the cache in some one-at-a-time order."""

    def __init__(self, cache: VectorCache) -> None:
        self.cache = cache

    @property
    def backend(self) -> BackendInfo:
        return BackendInfo("in_process", False, None, None, True, None, 0)

    @property
    def size(self) -> int:
        return self.cache.size

    @property
    def evictions_total(self) -> int:
        return self.cache.evictions_total

    @property
    def local_cache(self) -> VectorCache:
        return self.cache

    def health(self) -> Health:
        return Health()

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def compare(
        self, vectors: Sequence[Vector], trace_ids: Sequence[str], *, add: bool
    ) -> list[Comparison]:
        return compare_in_order(self.cache, vectors, add=add)

    async def stats(self) -> CacheStats:
        return self.cache.stats()

    async def clear(self) -> int:
        return self.cache.clear()
