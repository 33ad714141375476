"""The default novelty memory: one exact VectorCache per namespace, in this process (no
Redis needed)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from app.core.health import Health
from app.domain.vector_cache import (
    CacheEntries,
    CacheStats,
    Nearest,
    VectorCache,
    exact_cosine,
    wall_clock_ms,
)
from app.store.base import (
    DEFAULT_NAMESPACE,
    BackendInfo,
    Comparison,
    NamespaceLimitError,
    NearestTrace,
    Vector,
)
from app.store.journal import Journal

T = TypeVar("T")

#: From this many entries in a namespace an exact scan takes about a millisecond (384
#: dimensions, one core): compares run off the event loop from there on, so that other
#: requests' HTTP work does not wait for them. Below it a scan costs less than a thread's
#: hand-off.
OFF_LOOP_FROM = 20_000


def compare_in_order(
    cache: VectorCache, vectors: Sequence[Vector], trace_ids: Sequence[str], *, add: bool
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
            results.append(Comparison(None, 0, stored=add))
        else:
            nearest = NearestTrace(found.trace_id, found.cosine, max(0.0, now - found.added_at_ms))
            # An earlier trace of the call that beats the memory's answer is compared exactly,
            # but the memory's part is still only as exact as its search.
            results.append(Comparison(found.cosine, seen, nearest, searched, bound, stored=add))
        if add:
            cache.add(vector, trace_id=trace_id)
        else:
            pending.append((np.asarray(vector, dtype=np.float32), trace_id))
    return results


class InProcessMemory:
    """The memory of one process: a dict of exact VectorCaches, one per namespace, each with
    the same capacity and TTL. What changes them (compare, clear, import) meets them in one
    one-at-a-time order: as one step of the event loop while the namespace is small, and on
    one thread of its own, in the order asked, once an exact scan takes milliseconds that the
    loop's other requests would otherwise wait for. The loop takes the work back only once
    that thread has nothing left to do, so the order holds across the switch."""

    def __init__(
        self,
        capacity: int,
        *,
        dimensions: int = 384,
        ttl_ms: float | None = None,
        max_namespaces: int = 1000,
        off_loop_from: int = OFF_LOOP_FROM,
        clock_ms: Callable[[], float] = wall_clock_ms,
        journal: Journal | None = None,
    ) -> None:
        self.capacity = capacity
        self.ttl_ms = ttl_ms
        self.max_namespaces = max_namespaces
        self.off_loop_from = off_loop_from
        self._dimensions = dimensions
        self._clock_ms = clock_ms
        # One reentrant lock for every namespace: the snapshot's thread reads while the loop
        # (or the in-order thread) writes.
        self._lock = threading.RLock()
        self._caches: dict[str, VectorCache] = {}
        #: Set (beside a snapshot): every change of the default namespace is appended to it
        #: before it is answered.
        self.journal = journal
        self._in_order_thread = ThreadPoolExecutor(1, thread_name_prefix="kp-memory")
        self._on_thread = 0  # calls handed to the thread and not yet returned
        self._flusher: asyncio.Task[None] | None = None

    # ── namespaces ──────────────────────────────────────────────────────────

    def _new_cache(self) -> VectorCache:
        return VectorCache(
            self.capacity, self._dimensions, self.ttl_ms, self._clock_ms, lock=self._lock
        )

    def cache(self, namespace: str) -> VectorCache:
        """The namespace's cache, made when first asked (NamespaceLimitError past the limit
        of namespaces that hold entries)."""
        with self._lock:
            found = self._caches.get(namespace)
            if found is not None:
                return found
            holding = sum(1 for c in self._caches.values() if c.size)
            if holding >= self.max_namespaces:
                raise NamespaceLimitError(
                    f"namespace {namespace!r} would be number {holding + 1}: "
                    f"KP_MAX_NAMESPACES is {self.max_namespaces} (clear a namespace first)"
                )
            made = self._caches[namespace] = self._new_cache()
            return made

    def _forget_empty(self) -> None:
        """Drops empty caches but the default's (their counters go with them); in the
        memory's order only, so that no queued change holds a cache that was dropped."""
        for name in [n for n, c in self._caches.items() if n != DEFAULT_NAMESPACE and not c.size]:
            del self._caches[name]

    def _existing(self, namespace: str) -> VectorCache:
        """The namespace's cache, or an empty one that is not kept (reads never make one)."""
        with self._lock:
            return self._caches.get(namespace) or self._new_cache()

    def _searches_take_milliseconds(self, namespace: str) -> bool:
        cache = self._caches.get(namespace)
        return cache is not None and cache.size >= self.off_loop_from

    async def _in_order(self, namespace: str, work: Callable[[], T]) -> T:
        if self._on_thread == 0 and not self._searches_take_milliseconds(namespace):
            return work()
        self._on_thread += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._in_order_thread, work)
        finally:
            self._on_thread -= 1

    # ── the interface ───────────────────────────────────────────────────────

    @property
    def backend(self) -> BackendInfo:
        return BackendInfo("in_process", False, None, None, True, None, 0)

    @property
    def size(self) -> int:
        with self._lock:
            return sum(c.size for c in self._caches.values())

    @property
    def dimensions(self) -> int:
        return self._dimensions

    @property
    def evictions_total(self) -> int:
        with self._lock:
            return sum(c.evictions_total for c in self._caches.values())

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

    def _journaled(
        self, namespace: str, change: Callable[[VectorCache], T], *, clear: bool = False
    ) -> Callable[[], T]:
        """`change` on the namespace's cache as it is when its turn comes (made then if
        needed), then its record in the journal (which keeps the default namespace), as one
        step no rotation comes between."""
        journal = self.journal

        def target() -> VectorCache:
            # A clear never makes a namespace (nor counts against the limit).
            return self._existing(namespace) if clear else self.cache(namespace)

        if journal is None or namespace != DEFAULT_NAMESPACE:
            return lambda: change(target())

        def step() -> T:
            cache = target()
            with journal.lock:
                _, before = cache.sequence_range
                result = change(cache)
                if clear:
                    journal.record_clear()
                else:
                    first, after = cache.sequence_range
                    journal.record_adds(cache.entries_between(max(first, before), after))
                return result

        return step

    async def _durable(self, namespace: str, *, always: bool) -> None:
        """Before the answer: flushed to disk when the policy (or the change: imports and
        clears) asks for it; else written, and flushed within a second."""
        journal = self.journal
        if namespace != DEFAULT_NAMESPACE or journal is None:
            return
        if always or journal.fsync == "always":
            await asyncio.to_thread(journal.sync)

    async def compare(
        self, namespace: str, vectors: Sequence[Vector], trace_ids: Sequence[str], *, add: bool
    ) -> list[Comparison]:
        if not add:
            return await self._in_order(
                namespace,
                lambda: compare_in_order(self._existing(namespace), vectors, trace_ids, add=False),
            )

        def work(cache: VectorCache) -> list[Comparison]:
            return compare_in_order(cache, vectors, trace_ids, add=True)

        results = await self._in_order(namespace, self._journaled(namespace, work))
        await self._durable(namespace, always=False)
        return results

    async def namespaces(self) -> list[str]:
        with self._lock:
            return sorted(name for name, cache in self._caches.items() if cache.size)

    async def stats(self, namespace: str) -> CacheStats:
        return self._existing(namespace).stats()

    async def clear(self, namespace: str) -> int:
        def work(cache: VectorCache) -> int:
            cleared = cache.clear()
            self._forget_empty()
            return cleared

        cleared = await self._in_order(namespace, self._journaled(namespace, work, clear=True))
        await self._durable(namespace, always=True)
        return cleared

    async def export_chunks(self, namespace: str) -> AsyncIterator[CacheEntries]:
        for chunk in self._existing(namespace).chunks():
            yield chunk
            await asyncio.sleep(0)  # other requests go on between chunks

    async def import_entries(self, namespace: str, entries: CacheEntries) -> tuple[int, int]:
        if not len(entries.vectors):
            return 0, 0
        counts = await self._in_order(
            namespace, self._journaled(namespace, lambda cache: cache.append(entries))
        )
        await self._durable(namespace, always=True)
        return counts
