"""The default novelty memory: an IndexedCache in this process (no Redis needed)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from app.core.health import Health
from app.domain.vector_cache import CacheEntries, CacheStats, Nearest, exact_cosine
from app.store.base import BackendInfo, Comparison, NearestTrace, Vector
from app.store.indexed_memory import IndexedCache, IndexStatus
from app.store.journal import Journal

T = TypeVar("T")


def searches_take_milliseconds(cache: IndexedCache) -> bool:
    """From the index threshold on, a search (or an exact scan) takes milliseconds: compares
    run off the event loop, so that other requests' HTTP work does not wait for them. Below
    it a scan costs less than a thread's hand-off."""
    return cache.size >= cache.index_threshold


def compare_in_order(
    cache: IndexedCache, vectors: Sequence[Vector], trace_ids: Sequence[str], *, add: bool
) -> list[Comparison]:
    """Each vector against `cache`, then added to it when `add`. Without `add` (a dry run)
    several vectors still see the ones before them: the cache is left as it is, and each is
    compared with it less the oldest entries the earlier ones would have evicted, and with
    the earlier ones themselves (newer than any cached entry, so they win ties)."""
    results = []
    pending: list[tuple[Vector, str]] = []
    for vector, trace_id in zip(vectors, trace_ids, strict=True):
        now = cache.now_ms()
        size = cache.size
        evicted = max(0, size + len(pending) - cache.capacity)
        found = cache.nearest(vector, skip_oldest=evicted)
        searched, bound = ("exact", None) if found is None else (found.search, found.bound)
        for earlier, earlier_id in pending:
            cosine = exact_cosine(np.asarray(vector, dtype=np.float32), earlier)
            if found is None or cosine >= found.cosine:
                found = Nearest(cosine, earlier_id, now)
        seen = min(cache.capacity, size + len(pending))
        if found is None:
            results.append(Comparison(None, 0))
        else:
            nearest = NearestTrace(found.trace_id, found.cosine, max(0.0, now - found.added_at_ms))
            # An earlier trace of the call that beats the memory's answer is compared exactly,
            # but the memory's part is still only as exact as its search.
            results.append(Comparison(found.cosine, seen, nearest, searched, bound))
        if add:
            cache.add(vector, trace_id=trace_id)
        else:
            pending.append((np.asarray(vector, dtype=np.float32), trace_id))
    return results


class InProcessMemory:
    """The cache of one process. What changes it (compare, clear, import) meets it in one
    one-at-a-time order: as one step of the event loop while the cache is below its index
    threshold (a scan of up to about a millisecond), and on one thread of its own, in the
    order asked, from there on, where a search or an exact scan takes milliseconds that the
    loop's other requests would otherwise wait for. The loop takes the work back only once
    that thread has nothing left to do, so the order holds across the switch."""

    def __init__(self, cache: IndexedCache, journal: Journal | None = None) -> None:
        self.cache = cache
        #: Set (beside a snapshot): every change is appended to it before it is answered.
        self.journal = journal
        self._in_order_thread = ThreadPoolExecutor(1, thread_name_prefix="kp-memory")
        self._on_thread = 0  # calls handed to the thread and not yet returned
        self._flusher: asyncio.Task[None] | None = None

    async def _in_order(self, work: Callable[[], T]) -> T:
        if self._on_thread == 0 and not searches_take_milliseconds(self.cache):
            return work()
        self._on_thread += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._in_order_thread, work)
        finally:
            self._on_thread -= 1

    @property
    def backend(self) -> BackendInfo:
        return BackendInfo("in_process", False, None, None, True, None, 0)

    @property
    def size(self) -> int:
        return self.cache.size

    def index_status(self) -> IndexStatus:
        return self.cache.index_status()

    def run_audit(self, limit: int) -> int:
        return self.cache.run_audit(limit)

    @property
    def dimensions(self) -> int:
        return self.cache.dimensions

    @property
    def evictions_total(self) -> int:
        return self.cache.evictions_total

    @property
    def local_cache(self) -> IndexedCache:
        return self.cache

    def health(self) -> Health:
        return Health()

    async def start(self) -> None:
        if self.journal is not None and self.journal.fsync == "everysec":
            self._flusher = asyncio.create_task(self._flush_every_second(self.journal))

    async def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        await asyncio.to_thread(self._in_order_thread.shutdown)
        if self.journal is not None:
            await asyncio.to_thread(self.journal.close)

    @staticmethod
    async def _flush_every_second(journal: Journal) -> None:
        while True:
            await asyncio.sleep(1.0)
            await asyncio.to_thread(journal.sync)

    def _journaled(self, change: Callable[[], T], *, clear: bool = False) -> Callable[[], T]:
        """`change`, then its record in the journal, as one step no rotation comes between."""
        journal = self.journal
        if journal is None:
            return change

        def step() -> T:
            with journal.lock:
                _, before = self.cache.sequence_range
                result = change()
                if clear:
                    journal.record_clear()
                else:
                    first, after = self.cache.sequence_range
                    journal.record_adds(self.cache.entries_between(max(first, before), after))
                return result

        return step

    async def _durable(self, *, always: bool) -> None:
        """Before the answer: flushed to disk when the policy (or the change: imports and
        clears) asks for it; else written, and flushed within a second."""
        journal = self.journal
        if journal is not None and (always or journal.fsync == "always"):
            await asyncio.to_thread(journal.sync)

    async def compare(
        self, vectors: Sequence[Vector], trace_ids: Sequence[str], *, add: bool
    ) -> list[Comparison]:
        def work() -> list[Comparison]:
            return compare_in_order(self.cache, vectors, trace_ids, add=add)

        if not add:
            return await self._in_order(work)
        results = await self._in_order(self._journaled(work))
        await self._durable(always=False)
        return results

    async def stats(self) -> CacheStats:
        return self.cache.stats()

    async def clear(self) -> int:
        cleared = await self._in_order(self._journaled(self.cache.clear, clear=True))
        await self._durable(always=True)
        return cleared

    async def export_chunks(self) -> AsyncIterator[CacheEntries]:
        for chunk in self.cache.chunks():
            yield chunk
            await asyncio.sleep(0)  # other requests go on between chunks

    async def import_entries(self, entries: CacheEntries) -> tuple[int, int]:
        counts = await self._in_order(self._journaled(lambda: self.cache.append(entries)))
        await self._durable(always=True)
        return counts
