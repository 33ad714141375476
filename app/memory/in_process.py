"""The default novelty memory: one exact VectorCache per namespace, in this process, kept in
an SQLite database (app/memory/sqlite.py) when configured."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np

from app.core.health import Health
from app.memory.base import (
    DEFAULT_NAMESPACE,
    RECEIPT,
    BackendInfo,
    Comparison,
    MemoryFaults,
    MemoryUnavailableError,
    NamespaceLimitError,
    NearestTrace,
    Vector,
)
from app.memory.ring import (
    CacheEntries,
    CacheStats,
    Nearest,
    VectorCache,
    exact_cosine,
    wall_clock_ms,
)
from app.memory.sqlite import SqliteStore, StorageError
from app.memory.sqlite_rows import NewRow, entry_rows

T = TypeVar("T")

#: From this many entries a namespace's ring is prefaulted beside the load at start
#: (VectorCache.prefault): about 100 MB, where the page faults start to count.
PREFAULT_FROM = 65_536
#: Rows prefaulted under the memory's lock at a time: well under a millisecond of faults.
PREFAULT_BLOCK = 256


#: Rows the memory no longer holds are deleted from the database this many at a time: one
#: delete a commit cost a one-row commit 86-90 us p50 against 56-58 us
#: (docs/decisions/memory-in-sqlite.md); a start loads only what the memory would hold.
TRIM_FROM = 64
#: How often, at most, the memory lets go of namespaces whose every entry expired (their
#: rings, their rows): they no longer count against KP_MAX_NAMESPACES once expired.
FORGET_EVERY_S = 2.0
#: From this many entries (an exact scan of about a millisecond) a namespace's compares run off
#: the event loop (docs/decisions/large-memory-off-the-event-loop.md).
OFF_LOOP_FROM = 20_000


#: An entry compared but not yet in the cache: (vector, trace id, time).
Pending = tuple[Vector, str, float]


def compare_pending(
    cache: VectorCache,
    vectors: Sequence[Vector],
    trace_ids: Sequence[str],
    pending: list[Pending],
    *,
    stored: bool = False,
) -> list[Comparison]:
    """Each vector against `cache` as it would be with `pending` added, then appended to
    `pending`: the cache is left as it is, and each is compared with it less the oldest
    entries the pending ones would evict, and with the pending ones themselves (newer than
    any cached entry, so they win ties). What adding them one by one would answer."""
    results = []
    for vector, trace_id in zip(vectors, trace_ids, strict=True):
        now = cache.now_ms()
        size = cache.size
        evicted = max(0, size + len(pending) - cache.capacity)
        found = cache.nearest(vector, skip_oldest=evicted)
        for earlier, earlier_id, earlier_at in pending[max(0, len(pending) - cache.capacity) :]:
            cosine = exact_cosine(np.asarray(vector, dtype=np.float32), earlier)
            if found is None or cosine >= found.cosine:
                found = Nearest(cosine, earlier_id, earlier_at)
        seen = min(cache.capacity, size + len(pending))
        if found is None:
            results.append(Comparison(None, 0, stored=stored))
        else:
            nearest = NearestTrace(found.trace_id, found.cosine, max(0.0, now - found.added_at_ms))
            results.append(Comparison(found.cosine, seen, nearest, stored=stored))
        pending.append((np.asarray(vector, dtype=np.float32), trace_id, now))
    return results


@dataclass(eq=False, slots=True)
class _Item:
    """One change (or read) waiting for its turn: a trace compare that adds (`add`, grouped
    with the adds queued beside it into one commit), or any other `work`."""

    future: asyncio.Future[Any]
    work: Callable[[], Any] | None = None
    namespace: str = DEFAULT_NAMESPACE
    vectors: Sequence[Vector] = ()
    trace_ids: Sequence[str] = ()
    receipt: str | None = None


class InProcessMemory:
    """The memory of one process: an exact VectorCache per namespace, each with the same
    capacity and TTL, kept in an SQLite database when given one (`store`). What changes them
    meets them in one order: as one step of the event loop while the namespace is small and
    nothing needs the disk's flush, else on a thread of its own, in the order asked (the loop
    takes the work back only once that thread has nothing left). The adds queued together are
    compared in order as if each were added, committed in one transaction, then added
    (docs/decisions/memory-in-sqlite.md, large-memory-off-the-event-loop.md)."""

    def __init__(
        self,
        capacity: int,
        *,
        dimensions: int = 384,
        ttl_ms: float | None = None,
        max_namespaces: int = 1000,
        off_loop_from: int = OFF_LOOP_FROM,
        clock_ms: Callable[[], float] = wall_clock_ms,
        store: SqliteStore | None = None,
    ) -> None:
        self.capacity = capacity
        self.ttl_ms = ttl_ms
        self.max_namespaces = max_namespaces
        self.off_loop_from = off_loop_from
        self.store = store
        self.dimensions = dimensions
        self._clock_ms = clock_ms
        # One reentrant lock for every namespace: exports and metrics read while the loop
        # (or the in-order thread) writes.
        self._lock = threading.RLock()
        self._caches: dict[str, VectorCache] = {}
        self._in_order_thread = ThreadPoolExecutor(1, thread_name_prefix="kp-memory")
        self._queue: deque[_Item] = deque()
        self._queue_lock = threading.Lock()
        self._on_thread = 0  # items handed to the thread and not yet answered
        self._prefaulting: list[VectorCache] = []  # rings reserved at start, not yet prefaulted
        self._prefaulter: threading.Thread | None = None
        self._loaded = threading.Event()  # the start's load is over: no more prefaulting
        self._next_forget = 0.0  # time.monotonic() of the next look for empty namespaces
        self._forgotten_evictions = 0  # evictions of the namespaces let go
        self._dead: set[str] = set()  # namespaces let go whose rows are still in the database

    # ── namespaces ──────────────────────────────────────────────────────────

    def cache(self, namespace: str) -> VectorCache:
        """The namespace's cache, made when first asked (NamespaceLimitError past the limit
        of namespaces that hold entries). In the memory's order."""
        if time.monotonic() >= self._next_forget:
            self._forget_empty()
        self._admit(namespace, set())
        return self._cache(namespace, keep=True)

    def _cache(self, namespace: str, *, keep: bool) -> VectorCache:
        """The namespace's cache; else a new one, kept when `keep` (admitted already: reads
        never make one)."""
        with self._lock:
            found = self._caches.get(namespace)
            if found is None:
                found = VectorCache(
                    self.capacity, self.dimensions, self.ttl_ms, self._clock_ms, lock=self._lock
                )
                if keep:
                    self._caches[namespace] = found
            return found

    def _admit(self, namespace: str, fresh: set[str]) -> None:
        """NamespaceLimitError unless `namespace` holds entries, or may start to beside the
        ones that do and the `fresh` ones about to (added to `fresh` when new)."""
        with self._lock:
            found = self._caches.get(namespace)
            if (found is not None and found.size) or namespace in fresh:
                return
            holding = sum(1 for c in self._caches.values() if c.size) + len(fresh)
        if holding >= self.max_namespaces:
            raise NamespaceLimitError(
                f"namespace {namespace!r} would be number {holding + 1}: "
                f"KP_MAX_NAMESPACES is {self.max_namespaces} (clear a namespace first)"
            )
        fresh.add(namespace)

    def _forget_empty(self) -> None:
        """Drops empty caches but the default's (cleared, or every entry expired), giving
        their rings back; their rows are deleted from the database with the next write. In
        the memory's order only, so that no queued change holds a cache that was dropped."""
        store = self.store
        with self._lock:
            for name, cache in list(self._caches.items()):
                if name == DEFAULT_NAMESPACE or cache.size:
                    continue
                self._forgotten_evictions += self._caches.pop(name).evictions_total
                if store is not None and store.rows(name):
                    self._dead.add(name)
        self._next_forget = time.monotonic() + FORGET_EVERY_S

    # ── the order ───────────────────────────────────────────────────────────

    def _here(self, namespace: str, *, disk: bool) -> bool:
        """Whether work may run on the event loop in the memory's order: nothing is queued on
        the thread, `disk` is false (a write that must wait for the disk) and the namespace is
        small."""
        if self._on_thread or disk:
            return False
        cache = self._caches.get(namespace)
        return cache is None or cache.size < self.off_loop_from

    async def _in_order(self, namespace: str, work: Callable[[], T], *, disk: bool) -> T:
        """`work` in the memory's order: here when it may be (`_here`), else on the in-order
        thread."""
        if self._here(namespace, disk=disk):
            return work()
        loop = asyncio.get_running_loop()
        result: T = await self._submit(_Item(loop.create_future(), work=work))
        return result

    async def _submit(self, item: _Item) -> Any:
        with self._queue_lock:
            self._queue.append(item)
        self._on_thread += 1
        try:
            self._in_order_thread.submit(self._drain)
            return await item.future
        finally:
            self._on_thread -= 1

    def _drain(self) -> None:
        """On the in-order thread: every queued item in order, the adds at the head of the
        queue as one group."""
        while True:
            with self._queue_lock:
                if not self._queue:
                    return
                first = self._queue.popleft()
                group = [first]
                if first.work is None:
                    while self._queue and self._queue[0].work is None:
                        group.append(self._queue.popleft())
            if first.work is not None:
                try:
                    outcome = first.work()
                except Exception as exc:  # the caller's to handle
                    outcome = exc
                _settle(first, outcome)
            else:
                try:
                    outcomes = self._add_group(group)
                except Exception as exc:  # a bad vector: every request of the group hears it
                    outcomes = [exc] * len(group)
                for item, outcome in zip(group, outcomes, strict=True):
                    _settle(item, outcome)

    def _add_group(
        self, group: Sequence[_Item], *, on_loop: bool = False
    ) -> list[list[Comparison] | Exception]:
        """Adds made as one: compared in order as if each were added, committed as one
        transaction (with a database), then added. When the commit fails, each trace is
        compared with the memory as it is (nothing of the group in it) and answered as not
        stored. On the loop the database is open (`commit_waits` said so)."""
        store = self.store
        if store is not None and not on_loop:
            store.ensure_open()
        if time.monotonic() >= self._next_forget:
            self._forget_empty()
        outcomes: list[list[Comparison] | Exception] = []
        caches: dict[str, VectorCache] = {}
        pending: dict[str, list[Pending]] = {}
        held: dict[str, int] = {}
        fresh: set[str] = set()
        receipts: list[tuple[str, str]] = []
        for item in group:
            ns = item.namespace
            # Without a database a receipt is not kept: what a crash loses, the memory loses too.
            kept = None if item.receipt is None or store is None else store.receipt(item.receipt)
            if kept is not None:  # committed before, its answer lost: the same, nothing added
                outcomes.append(RECEIPT.validate_json(kept))
                continue
            cache = caches.get(ns) or self._caches.get(ns) or self._cache(ns, keep=False)
            if ns not in held and not cache.size and ns not in fresh:
                try:
                    self._admit(ns, fresh)
                except NamespaceLimitError as exc:
                    outcomes.append(exc)
                    continue
            caches[ns] = cache
            held.setdefault(ns, cache.size)
            queued = pending.setdefault(ns, [])
            compared = compare_pending(cache, item.vectors, item.trace_ids, queued, stored=True)
            outcomes.append(compared)
            if item.receipt is not None and store is not None:
                receipts.append((item.receipt, RECEIPT.dump_json(compared).decode()))
        if store is not None:
            rows = [
                NewRow(ns, trace_id, at, vector.astype("<f4", copy=False).tobytes())
                for ns, queued in pending.items()
                for vector, trace_id, at in queued
            ]
            try:
                store.write(
                    rows,
                    held=held,
                    forget=self._dead,
                    checkpoint=not on_loop,
                    trim_from=TRIM_FROM,
                    receipts=receipts,
                )
            except StorageError as exc:
                return [
                    outcome if isinstance(outcome, Exception) else self._unstored(item, str(exc))
                    for item, outcome in zip(group, outcomes, strict=True)
                ]
            self._dead.clear()
        for ns, queued in pending.items():
            if not queued:
                continue
            with self._lock:  # kept from here when new: admitted above
                cache = self._caches.setdefault(ns, caches[ns])
            cache.extend(
                np.stack([v for v, _, _ in queued]),
                np.array([at for _, _, at in queued], dtype=np.float64),
                [trace_id for _, trace_id, _ in queued],
            )
        return outcomes

    def _unstored(self, item: _Item, reason: str) -> list[Comparison]:
        """Each trace of `item` against the memory alone, answered as not stored."""
        cache = self._cache(item.namespace, keep=False)
        return [
            replace(compare_pending(cache, [v], [t], [])[0], not_stored=reason)
            for v, t in zip(item.vectors, item.trace_ids, strict=True)
        ]

    # ── the interface ───────────────────────────────────────────────────────

    @property
    def backend(self) -> BackendInfo:
        location = None if self.store is None else str(self.store.path)
        return BackendInfo("in_process", False, location, None, True, None, 0)

    @property
    def size(self) -> int:
        with self._lock:
            return sum(c.size for c in self._caches.values())

    @property
    def evictions_total(self) -> int:
        with self._lock:
            live = sum(c.evictions_total for c in self._caches.values())
            return self._forgotten_evictions + live

    @property
    def faults(self) -> MemoryFaults:
        return MemoryFaults()

    def health(self) -> Health:
        return Health() if self.store is None else self.store.health()

    async def start(self) -> None:
        """Loads the database (off the loop) when there is one."""
        store = self.store
        if store is None:
            return

        def open_and_trim() -> None:
            try:
                store.open(self)
            finally:
                self._loaded.set()
                if self._prefaulter is not None:
                    self._prefaulter.join()
            with self._lock:
                held = {ns: c.size for ns, c in self._caches.items()}
            # Rows past the capacity or the TTL (or of a smaller capacity than before).
            if any(store.rows(ns) > kept for ns, kept in held.items()):
                with contextlib.suppress(StorageError):
                    store.write(held=held)

        await asyncio.to_thread(open_and_trim)

    # SqliteStore's LoadTarget: where the database's entries go at start.

    def load(self, namespace: str, entries: CacheEntries) -> None:
        self._cache(namespace, keep=True).extend(
            entries.vectors, entries.added_at_ms, entries.ids()
        )

    def reserve(self, namespace: str, rows: int) -> None:
        cache = self._cache(namespace, keep=True)
        cache.reserve(rows)
        if rows >= PREFAULT_FROM:
            self._prefaulting.append(cache)
            if self._prefaulter is None or not self._prefaulter.is_alive():
                self._prefaulter = threading.Thread(
                    target=self._prefault, name="kp-prefault", daemon=True
                )
                self._prefaulter.start()

    def _prefault(self) -> None:
        """The rings a start reserves, prefaulted while the database is read: the first write
        to each page of a fresh ring costs a fault, here paid on the other core instead of in
        the load's copies. The kernel's work, not the GIL's."""
        while not self._loaded.is_set():
            try:
                cache = self._prefaulting[0]
            except IndexError:
                return  # every ring prefaulted, or reset() took them
            if not cache.prefault(PREFAULT_BLOCK):
                with contextlib.suppress(ValueError):  # reset() may have taken it
                    self._prefaulting.remove(cache)
            time.sleep(0)  # the load's thread takes the memory's lock between blocks

    def reset(self) -> None:
        self._prefaulting.clear()  # no longer the memory's rings (a load started over)
        with self._lock:
            self._caches.clear()

    def held(self) -> Iterator[tuple[str, CacheEntries]]:
        """Every entry, a chunk of one namespace at a time, oldest first (a database written
        anew); in the memory's order."""
        with self._lock:
            names = list(self._caches)
        for name in names:
            for chunk in self._cache(name, keep=False).chunks():
                yield name, chunk

    async def close(self) -> None:
        await asyncio.to_thread(self._in_order_thread.shutdown)
        if self.store is not None:
            await asyncio.to_thread(self.store.close)

    async def compare(
        self,
        namespace: str,
        vectors: Sequence[Vector],
        trace_ids: Sequence[str],
        *,
        add: bool,
        receipt: str | None = None,
    ) -> list[Comparison]:
        if not add:  # a dry run: it makes no namespace
            return await self._in_order(
                namespace,
                lambda: compare_pending(self._cache(namespace, keep=False), vectors, trace_ids, []),
                disk=False,
            )
        loop = asyncio.get_running_loop()
        item = _Item(loop.create_future(), None, namespace, vectors, trace_ids, receipt)
        # A `process` commit is a write to the kernel, cheaper than the hand-off to the
        # thread; a checkpoint syncs, so the commit that finds one due takes the thread, as
        # does a database that is opened again (and loaded) before its commit.
        if self._here(namespace, disk=self.store is not None and self.store.commit_waits):
            (outcome,) = self._add_group([item], on_loop=True)
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        results: list[Comparison] = await self._submit(item)
        return results

    async def namespaces(self) -> list[str]:
        with self._lock:
            return sorted(name for name, cache in self._caches.items() if cache.size)

    async def stats(self, namespace: str) -> CacheStats:
        return self._cache(namespace, keep=False).stats()

    async def clear(self, namespace: str) -> int:
        def work() -> int:
            if self.store is not None:
                self.store.ensure_open()
                self._commit(self.store, "cleared", forget={*self._dead, namespace})
            with self._lock:
                cache = self._caches.get(namespace)
            cleared = 0 if cache is None else cache.clear()
            self._forget_empty()
            return cleared

        return await self._in_order(namespace, work, disk=self.store is not None)

    async def export_chunks(self, namespace: str) -> AsyncIterator[CacheEntries]:
        for chunk in self._cache(namespace, keep=False).chunks():
            yield chunk
            await asyncio.sleep(0)  # other requests go on between chunks

    async def import_entries(self, namespace: str, entries: CacheEntries) -> tuple[int, int]:
        if not len(entries.vectors):
            return 0, 0

        def work() -> tuple[int, int]:
            store = self.store
            if store is not None:
                store.ensure_open()
            cache = self.cache(namespace)
            # An entry already past the TTL is skipped; a time in the future is lowered to now.
            now = cache.now_ms()
            times = np.minimum(np.asarray(entries.added_at_ms, dtype=np.float64), now)
            ttl = self.ttl_ms
            keep = np.full(len(times), True) if ttl is None else times > now - ttl
            ids = [trace_id for trace_id, kept in zip(entries.ids(), keep, strict=True) if kept]
            vectors, times = np.asarray(entries.vectors)[keep], times[keep]
            if store is not None:
                rows = entry_rows(namespace, CacheEntries(vectors, times, ids))
                self._commit(store, "imported", rows, held={namespace: cache.size})
            cache.extend(vectors, times, ids)
            return len(ids), len(keep) - len(ids)

        return await self._in_order(namespace, work, disk=self.store is not None)

    def _commit(
        self, store: SqliteStore, what: str, rows: Sequence[NewRow] = (), **change: Any
    ) -> None:
        """An operator's change (SqliteStore.write's `held`, or `forget` of a namespace cleared)
        committed with the namespaces let go; MemoryUnavailableError (nothing was `what`) when
        it cannot be."""
        change.setdefault("forget", self._dead)
        try:
            store.write(rows, **change)
        except StorageError as exc:
            raise MemoryUnavailableError(
                f"the memory's database cannot be written ({exc}): nothing was {what}"
            ) from None
        self._dead.clear()


def _settle(item: _Item, outcome: Any) -> None:
    """Hands an outcome (a result, or an Exception to raise) to the waiting request, on its
    loop (it may have gone: cancelled)."""

    def settle() -> None:
        if item.future.done():
            return
        if isinstance(outcome, Exception):
            item.future.set_exception(outcome)
        else:
            item.future.set_result(outcome)

    item.future.get_loop().call_soon_threadsafe(settle)
