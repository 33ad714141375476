"""The process-wide vector cache that novelty is measured against (docs/scoring.md).

A ring buffer of float32 rows: adding never moves data, eviction is oldest first. Every entry
has a sequence number (its place in the order since the cache was made) and a trace id, so an
answer names the stored trace it resembles most (ties: the newest).

Below `index_threshold` entries, or with search="exact", the search is one matrix-vector
product over every row; cosines are then recomputed in float64 for the few rows that can be
the maximum, so the result equals the reference's double-precision loop, not just nearly.

At or above the threshold (search="auto") an HNSW graph (app.domain.ann_index) proposes
candidates (a second, wider search when the best of them is far: the graph's weak case) and
the same float64 rescoring picks among them, so `max_cosine` is always a true cosine with a
stored vector. No graph insert is on the request path: the graph is built in a
background thread on a copy of the rows (the exact scan answers meanwhile), and the newest
entries wait in a tail, scanned exactly, until a second background thread (the feeder) inserts
them a few at a time under the lock, so no search ever runs on a graph being added to. Evicted
and expired entries are excluded from every search at once by the id range; once they are a
third of the graph, a new graph is built on the live entries in the background and replaces
the old one whole.

A graph built elsewhere (beside a snapshot, published by another replica) can be adopted
instead of built (`adopt_index`, checked against the rows; the entries newer than it are
inserted as a build's are before it serves); each graph built here is handed,
serialized while still private, to the owner (`on_graph_built`) to keep or share, and so is
the serving graph each time the feeder has grown it by a tenth.
"""

from __future__ import annotations

import atexit
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import numpy.typing as npt

from app.domain.ann_index import DEFAULT_PARAMS, AnnIndex, one_core_for_this_thread

Vector = npt.NDArray[np.float32]
SearchMode = Literal["exact", "auto"]
IndexState = Literal["off", "building", "ready"]

# float32 dot products of unit vectors are within ~1e-6 of the exact value; every row this close
# to the float32 maximum is rescored exactly.
_RESCORE_MARGIN = 1e-4
#: Below this many entries the exact scan is about as fast as the index (about 1 ms a query on
#: one core), so the index is not built.
DEFAULT_INDEX_THRESHOLD = 20_000
#: A build has caught up (and swaps its graph in) when fewer than this many entries wait;
#: without background threads, the tail joins the graph when it reaches this many.
TAIL_BATCH = 512
#: Graph inserts the feeder makes per hold of the lock (about half a millisecond each at a
#: million entries), so a query waits for at most about a millisecond of them.
FEED_BATCH = 2
#: The feeder hands the serving graph on (on_graph_built) when it has grown by this share of its
#: entries since it was last handed on: a restart or a new replica then adopts a graph that
#: lacks at most about this share, not everything since the last build (up to half of it).
HAND_ON_GROWTH = 0.1
#: An idle feeder waits this long for new entries before its thread ends.
_FEED_LINGER_S = 5.0
#: A new graph replaces the serving one when the evicted entries it still holds reach this
#: share of its live ones (the graph's memory stays under 1.5 x the capacity's).
DEAD_PER_LIVE = 0.5
#: Rows the background work copies or scans under the lock at a time, so a request never
#: waits for more than about a millisecond of it.
_CHUNK = 4_096

#: Set at interpreter exit (_stop_background_work): graph builds and feeders stop at their
#: next step.
_EXITING = threading.Event()
#: Every cache, for _stop_background_work (weakly: a cache no one holds is let go).
_CACHES: weakref.WeakSet[VectorCache] = weakref.WeakSet()
#: How long exit waits for one background thread's current step (a chunk of a build, a
#: graph's serialization: seconds at a million entries).
_EXIT_JOIN_S = 60.0


@atexit.register
def _stop_background_work() -> None:
    """The interpreter's finalization unwinds a daemon thread that is inside faiss (a build,
    the feeder) through OpenMP's frames, which aborts the process ("terminate called without
    an active exception", exit status 134): at exit they stop at their next step and are
    waited for first."""
    _EXITING.set()
    threads: list[threading.Thread] = []
    for cache in list(_CACHES):
        with cache._lock:  # taken once the feeder's current insert is done
            cache._feed_wake.notify_all()
            threads += [t for t in (cache._building, cache._feeder) if t is not None]
    for thread in threads:
        thread.join(_EXIT_JOIN_S)


#: One index query in this many is rerun exactly in the background (the self-check).
AUDIT_EVERY = 100
#: The graph is built again (in the background) when the memory has grown this many times past
#: the sample its codes were trained on, up to a sample of _SAMPLE.
RETRAIN_GROWTH = 4
_SAMPLE = 131_072
_AUDIT_QUEUE = 64


def wall_clock_ms() -> float:
    return time.time() * 1000.0


@dataclass(frozen=True, slots=True)
class Nearest:
    """The stored entry with the largest cosine to a query (ties: the newest)."""

    cosine: float
    trace_id: str
    added_at_ms: float


@dataclass(frozen=True, slots=True)
class CacheStats:
    size: int
    capacity: int
    dimensions: int
    ttl_ms: float | None
    memory_bytes: int
    oldest_age_ms: float | None
    newest_age_ms: float | None
    adds_total: int
    evictions_total: int


@dataclass(frozen=True, slots=True)
class IndexStatus:
    """The approximate index, for operators (/cache, /readyz, metrics)."""

    search: SearchMode
    threshold: int
    state: IndexState
    indexed: int  # entries in the index (the rest are in the exactly-scanned tail)
    progress: float | None  # while building: the share of entries indexed so far
    warming: bool  # the first build since the cache was filled (restart, catch-up) runs
    audits_total: int  # index answers rerun exactly
    audit_agreements_total: int  # ... that found the same maximum
    builds_total: int = 0  # graphs built here (and swapped in)
    adoptions_total: int = 0  # graphs built elsewhere (a snapshot, another replica) adopted
    far_searches_total: int = 0  # index answers that took the second, wider search


@dataclass(frozen=True, slots=True)
class CacheEntries:
    """The cached vectors oldest first, with the wall-clock time (ms) each was added and the
    trace id it came from ('' when unknown)."""

    vectors: npt.NDArray[np.float32]
    added_at_ms: npt.NDArray[np.float64]
    trace_ids: Sequence[str] = ()
    #: Where they stand in the cache they were copied from: the sequence number of the first
    #: and the cache's lineage (see VectorCache.lineage); None / '' when unknown.
    first_seq: int | None = None
    lineage: str = ""

    def ids(self) -> Sequence[str]:
        return self.trace_ids if len(self.trace_ids) else [""] * len(self.vectors)


@dataclass(frozen=True, slots=True)
class BuiltGraph:
    """A graph this cache just built and swapped in, or its serving graph grown by the
    feeder, serialized (AnnIndex.to_bytes) for its owner to keep or share: its internal id 0
    is the entry `first_seq` of `lineage`."""

    data: bytes | bytearray
    first_seq: int
    count: int
    lineage: str


class VectorCache:
    """Bounded, thread-safe store of vectors with maximum-cosine search (module docstring)."""

    def __init__(
        self,
        capacity: int = 1000,
        dimensions: int = 384,
        ttl_ms: float | None = None,
        clock_ms: Callable[[], float] = wall_clock_ms,
        *,
        search: SearchMode = "auto",
        index_threshold: int = DEFAULT_INDEX_THRESHOLD,
        index_ef_search: int = DEFAULT_PARAMS.ef_search,
        index_ef_search_far: int = DEFAULT_PARAMS.ef_search_far,
        background: bool = True,
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        if dimensions < 1:
            raise ValueError("dimensions must be at least 1")
        if ttl_ms is not None and ttl_ms <= 0:
            raise ValueError("ttl_ms must be positive")
        if index_threshold < 1:
            raise ValueError("index_threshold must be at least 1")
        if index_ef_search < 1:
            raise ValueError("index_ef_search must be at least 1")
        if index_ef_search_far < 0:
            raise ValueError("index_ef_search_far must be 0 (off) or positive")
        self.capacity = capacity
        self.dimensions = dimensions
        self.ttl_ms = ttl_ms
        self.search = search
        self.index_threshold = index_threshold
        self._index_params = replace(
            DEFAULT_PARAMS, ef_search=index_ef_search, ef_search_far=index_ef_search_far
        )
        self._background = background
        self._clock_ms = clock_ms
        self._lock = threading.RLock()
        # Rows are allocated as the cache grows, so a large capacity costs nothing up front.
        self._vectors = np.empty((0, dimensions), dtype=np.float32)
        self._norms = np.empty(0, dtype=np.float64)
        self._added_at = np.empty(0, dtype=np.float64)
        self._trace_ids = np.empty(0, dtype=object)
        self._head = 0  # slot of the oldest entry
        self._size = 0
        self._first_seq = 0  # sequence number of the oldest entry
        self.adds_total = 0
        self.evictions_total = 0
        self.clears_total = 0
        # The serving graph: the live entries with seq < _index.stop_id are in it.
        self._index: AnnIndex | None = None
        self._building: threading.Thread | None = None
        self._feeding = False  # the feeder thread runs
        self._feeder: threading.Thread | None = None
        _CACHES.add(self)
        self._feed_wake = threading.Condition(self._lock)
        self._build_progress = 0.0
        self._generation = 0  # changes with clear/load: a build of an older one is dropped
        # Set once an index has served: later builds (after a clear, past the threshold
        # again) happen while the exact scan answers and do not make the service unready.
        self._ever_indexed = False
        self._trained_on = 0  # the sample the graph's codes were trained on
        self._queries = 0
        self.far_searches_total = 0  # index answers that took the second, wider search
        self._audit_queue: deque[tuple[Vector, float, int]] = deque(maxlen=_AUDIT_QUEUE)
        self.audits_total = 0
        self.audit_agreements_total = 0
        self.index_builds_total = 0
        self.index_adoptions_total = 0
        # While held, no build starts (the owner expects a graph to adopt); the exact scan
        # answers and the cache says warming.
        self._hold = False
        #: Called with every graph built (from the build thread, after the swap) and with the
        #: serving graph the feeder grew by a tenth (from the feeder), outside the lock; must
        #: not raise. Set by the owner (snapshots, the shared memory).
        self.on_graph_built: Callable[[BuiltGraph], None] | None = None
        #: Asked (first_seq, count, lineage), outside the lock, before the feeder serializes a
        #: grown graph for on_graph_built: False when the owner has no use for it now (a
        #: replica whose published graph another replica keeps current).
        self.graph_wanted: Callable[[int, int, str], bool] | None = None
        self._handed_stop = 0  # the stop_id of the serving graph when it was last handed on
        self.lineage = uuid.uuid4().hex  # the sequence numbers' identity: new at load/clear

    # ── queries ─────────────────────────────────────────────────────────────

    @property
    def size(self) -> int:
        with self._lock:
            self._drop_expired()
            return self._size

    def max_cosine_similarity(self, query: npt.ArrayLike) -> float:
        """The largest cosine between `query` and a cached vector; 0.0 when the cache is empty."""
        found = self.nearest(query)
        return 0.0 if found is None else found.cosine

    def nearest(self, query: npt.ArrayLike, skip_oldest: int = 0) -> Nearest | None:
        """The entry with the largest cosine to `query` (ties: the newest); None when empty.
        `skip_oldest`: leave out that many of the oldest entries (those a dry run's earlier
        traces would have evicted)."""
        q = self._as_vector(query)
        with self._lock:
            self._drop_expired()
            first = self._first_seq + max(0, skip_oldest)
            next_seq = self._first_seq + self._size
            if first >= next_seq:
                return None
            if self._index is None:
                return self._best(q, self._exact_candidates(q, first, next_seq))
            tail_from = max(first, self._index.stop_id)
            proposed = self._index.search(_unit(q), first)
            candidates = np.concatenate([proposed, self._exact_candidates(q, tail_from, next_seq)])
            if len(candidates) == 0:  # the graph held no live entry it could reach
                candidates = self._exact_candidates(q, first, next_seq)
            found = self._best(q, candidates)
            params = self._index.params
            if found.cosine < params.far_below and params.ef_search_far > params.ef_search:
                # Far from everything found: the graph's weak case (ann_index.DEFAULT_PARAMS).
                self.far_searches_total += 1
                wider = self._index.search(_unit(q), first, params.ef_search_far)
                found = self._best(q, np.concatenate([candidates, wider]))
            self._queries += 1
            if self._queries % AUDIT_EVERY == 0:
                self._audit_queue.append((q.copy(), found.cosine, next_seq))
            return found

    def now_ms(self) -> float:
        """The cache's clock (ages are measured on it)."""
        return self._clock_ms()

    def stats(self) -> CacheStats:
        with self._lock:
            self._drop_expired()
            now = self._clock_ms()
            times = (
                self._added_at[self._slots(self._first_seq, self._first_seq + self._size)[[0, -1]]]
                if self._size
                else np.empty(0)
            )
            index_bytes = self._index.memory_bytes if self._index is not None else 0
            return CacheStats(
                size=self._size,
                capacity=self.capacity,
                dimensions=self.dimensions,
                ttl_ms=self.ttl_ms,
                memory_bytes=int(
                    self._vectors.nbytes
                    + self._norms.nbytes
                    + self._added_at.nbytes
                    + self._trace_ids.nbytes
                    + index_bytes
                ),
                oldest_age_ms=float(now - times[0]) if self._size else None,
                newest_age_ms=float(now - times[-1]) if self._size else None,
                adds_total=self.adds_total,
                evictions_total=self.evictions_total,
            )

    def index_status(self) -> IndexStatus:
        with self._lock:
            building = self._building is not None and self._building.is_alive()
            state: IndexState = (
                "building" if building else "ready" if self._index is not None else "off"
            )
            indexed = 0
            if self._index is not None:
                indexed = max(0, self._index.stop_id - self._first_seq)
            return IndexStatus(
                search=self.search,
                threshold=self.index_threshold,
                state=state,
                indexed=min(indexed, self._size),
                progress=self._build_progress if building else None,
                warming=(building and not self._ever_indexed)
                or (self._hold and self._index is None and self._wants_index()),
                audits_total=self.audits_total,
                audit_agreements_total=self.audit_agreements_total,
                builds_total=self.index_builds_total,
                adoptions_total=self.index_adoptions_total,
                far_searches_total=self.far_searches_total,
            )

    def entries(self) -> CacheEntries:
        """A copy of the live entries, oldest first (for snapshots)."""
        with self._lock:
            self._drop_expired()
            first, size = self._first_seq, self._size
        return self.entries_between(first, first + size)

    def entries_between(self, start_seq: int, stop_seq: int) -> CacheEntries:
        """A copy of the live entries with start_seq <= seq < stop_seq, oldest first, taken
        a chunk at a time so that a large copy does not hold up queries."""
        vectors, times, ids = [], [], []
        seq = start_seq
        first: int | None = None
        lineage = ""
        contiguous = True  # no entry left (or clear) between two chunks
        while True:
            with self._lock:
                self._drop_expired()
                if first is not None and (seq < self._first_seq or lineage != self.lineage):
                    contiguous = False
                seq = max(seq, self._first_seq)
                stop = min(stop_seq, self._first_seq + self._size, seq + _CHUNK)
                if seq >= stop:
                    break
                if first is None:
                    first, lineage = seq, self.lineage
                slots = self._slots(seq, stop)
                vectors.append(self._vectors[slots])
                times.append(self._added_at[slots])
                ids.extend(self._trace_ids[slots].tolist())
                seq = stop
        if not vectors:
            return CacheEntries(np.empty((0, self.dimensions), dtype=np.float32), np.empty(0), [])
        if not contiguous:
            first, lineage = None, ""
        return CacheEntries(np.concatenate(vectors), np.concatenate(times), ids, first, lineage)

    @property
    def sequence_range(self) -> tuple[int, int]:
        """(first, next): the live entries' sequence numbers are first <= seq < next."""
        with self._lock:
            self._drop_expired()
            return self._first_seq, self._first_seq + self._size

    # ── updates ─────────────────────────────────────────────────────────────

    def add(
        self, vector: npt.ArrayLike, added_at_ms: float | None = None, trace_id: str = ""
    ) -> None:
        """Append a vector; the oldest entry goes when the cache is over capacity."""
        v = self._as_vector(vector)
        with self._lock:
            now = self._clock_ms() if added_at_ms is None else added_at_ms
            if self._size:
                # Keep insertion times ordered so that expiry is always a prefix of the ring.
                now = max(now, float(self._added_at[self._tail_index()]))
            if self._size == self.capacity:
                self._head = (self._head + 1) % self.capacity
                self._size -= 1
                self._first_seq += 1
                self.evictions_total += 1
            elif self._size == len(self._vectors):
                self._grow()
            slot = (self._head + self._size) % len(self._vectors)
            self._vectors[slot] = v
            self._norms[slot] = _norm64(v)
            self._added_at[slot] = now
            self._trace_ids[slot] = trace_id
            self._size += 1
            self.adds_total += 1
            self._maintain_index()

    def extend(
        self,
        vectors: npt.NDArray[np.float32],
        added_at_ms: npt.NDArray[np.float64],
        trace_ids: Sequence[str],
    ) -> None:
        """`add` for many vectors at once (a replica reading the shared log): the same
        entries, times, evictions and counts as adding them one by one, in one copy."""
        n = len(vectors)
        if n == 0:
            return
        v = np.asarray(vectors, dtype=np.float32)
        if v.ndim != 2 or v.shape[1] != self.dimensions or not np.isfinite(v).all():
            raise ValueError(f"expected finite vectors of {self.dimensions} dimensions")
        times = np.asarray(added_at_ms, dtype=np.float64)
        ids = np.empty(n, dtype=object)
        ids[:] = list(trace_ids)
        with self._lock:
            if self._size:
                newest = float(self._added_at[self._tail_index()])
                times = np.maximum.accumulate(np.concatenate([[newest], times]))[1:]
            else:
                times = np.maximum.accumulate(times)
            skipped = max(0, n - self.capacity)  # added and evicted within this call
            if skipped:
                self._first_seq += self._size + skipped
                self.evictions_total += self._size + skipped
                self._head, self._size = 0, 0
                v, times, ids = v[skipped:], times[skipped:], ids[skipped:]
            evicted = max(0, self._size + len(v) - self.capacity)
            if evicted:
                self._head = (self._head + evicted) % len(self._vectors)
                self._size -= evicted
                self._first_seq += evicted
                self.evictions_total += evicted
            while len(self._vectors) < min(self.capacity, self._size + len(v)):
                self._grow()
            slots = (self._head + self._size + np.arange(len(v))) % len(self._vectors)
            wide = v.astype(np.float64)
            self._vectors[slots] = v
            self._norms[slots] = np.sqrt((wide * wide).sum(axis=1))
            self._added_at[slots] = times
            self._trace_ids[slots] = ids
            self._size += len(v)
            self.adds_total += n
            self._maintain_index()

    def append(self, entries: CacheEntries) -> tuple[int, int]:
        """Adds `entries` (oldest first) as the newest entries, each keeping its time where
        the order allows (raised to the newest entry's, lowered to now); an entry already
        past the TTL is skipped. Returns (added, skipped)."""
        added = skipped = 0
        with self._lock:
            now = self._clock_ms()
            for vector, added_at, trace_id in zip(
                entries.vectors, entries.added_at_ms, entries.ids(), strict=True
            ):
                if self.ttl_ms is not None and added_at <= now - self.ttl_ms:
                    skipped += 1
                    continue
                self.add(vector, min(float(added_at), now), trace_id)
                added += 1
        return added, skipped

    def chunks(self, size: int = _CHUNK) -> Iterator[CacheEntries]:
        """The live entries oldest first, a copy of `size` at a time (for exports); entries
        evicted meanwhile are left out, entries added meanwhile are not included."""
        first, stop = self.sequence_range
        seq = first
        while seq < stop:
            chunk = self.entries_between(seq, min(stop, seq + size))
            seq += size
            if len(chunk.vectors):
                yield chunk

    def copy(self) -> VectorCache:
        """An independent cache with the same entries and settings, searched exactly (it
        lives for one dry run: an index would not pay for itself)."""
        with self._lock:
            other = VectorCache(
                self.capacity, self.dimensions, self.ttl_ms, self._clock_ms, search="exact"
            )
            other.load(self.entries())
            return other

    def load(self, entries: CacheEntries) -> None:
        """Replace the contents with `entries` (oldest first); the newest `capacity` are kept."""
        vectors = np.asarray(entries.vectors, dtype=np.float32)
        added_at = np.asarray(entries.added_at_ms, dtype=np.float64)
        if vectors.ndim != 2 or vectors.shape[1] != self.dimensions:
            raise ValueError(
                f"expected vectors of {self.dimensions} dimensions, got {vectors.shape}"
            )
        trace_ids = list(entries.ids())
        if (
            added_at.shape != (len(vectors),)
            or len(trace_ids) != len(vectors)
            or not np.isfinite(vectors).all()
        ):
            raise ValueError("entries are inconsistent or not finite")
        vectors, added_at = (
            vectors[-self.capacity :],
            np.maximum.accumulate(added_at[-self.capacity :]),
        )
        ids = np.empty(len(vectors), dtype=object)
        ids[:] = trace_ids[len(trace_ids) - len(vectors) :]
        with self._lock:
            self._first_seq += self._size  # the new entries are numbered after the old ones
            self._vectors = vectors.copy()
            self._norms = _row_norms(self._vectors)
            self._added_at = added_at.copy()
            self._trace_ids = ids
            self._head = 0
            self._size = len(vectors)
            self._reset_index()
            self._maintain_index()

    def clear(self) -> int:
        """Empty the cache; returns how many vectors were dropped."""
        with self._lock:
            dropped = self._size
            self._first_seq += self._size
            self._head = 0
            self._size = 0
            self.clears_total += 1
            self._reset_index()
            return dropped

    # ── the index and the self-check ────────────────────────────────────────

    def hold_index(self, hold: bool) -> None:
        """While held, no graph build starts (the owner is fetching one to adopt); the exact
        scan answers and index_status says warming. Releasing starts what is due."""
        with self._lock:
            self._hold = hold
            if not hold:
                self._maintain_index()

    def adopt_index(self, index: AnnIndex, first_id: int) -> str | None:
        """Serves `index`, a graph built elsewhere (a snapshot, another replica), whose
        internal id 0 is this cache's entry `first_id` (below first_seq: a dead prefix, as
        after evictions). It must cover the oldest live entry and hold no entry this cache
        has not; its codes are checked against the rows at a few entries. The entries after
        it are inserted before it serves (as a build's, while the cache warms) when they are a
        batch or more, else by the feeder. Returns None when adopted, else why not (nothing
        changes)."""
        with self._lock:
            self._drop_expired()
            next_seq = self._first_seq + self._size
            stop = first_id + index.count
            why = None
            if self.search == "exact":
                why = "KP_CACHE_SEARCH=exact"
            elif index.dimensions != self.dimensions:
                why = f"{index.dimensions} dimensions, the cache has {self.dimensions}"
            elif (index.params.m, index.params.ef_construction) != (
                self._index_params.m,
                self._index_params.ef_construction,
            ):
                why = f"built with {index.params}, the cache builds with {self._index_params}"
            elif not (first_id <= self._first_seq < stop <= next_seq):
                why = (
                    f"it covers entries {first_id}..{stop - 1}, the cache holds "
                    f"{self._first_seq}..{next_seq - 1}"
                )
            else:
                why = self._codes_differ(index, first_id, stop)
            if why is not None:
                return why
            index.first_id = first_id
            index.params = self._index_params  # the query-time settings are this cache's
            self._generation += 1  # a build of the entries running meanwhile is dropped
            self._building = None
            self._trained_on = min(index.count, _SAMPLE)
            self.index_adoptions_total += 1
            self._handed_stop = index.stop_id  # its owner has it
            if next_seq - stop >= TAIL_BATCH and self._background:
                # Entries since the graph was made (a replica published it a while ago): they
                # join it as a build's would, in bulk on every core while the cache warms,
                # not two at a time on one core behind a ready flag with a long exact tail.
                self._start_build(seed=index)
                return None
            self._index = index
            self._ever_indexed = True
            self._build_progress = 1.0
            self._maintain_index()
            return None

    def _codes_differ(self, index: AnnIndex, first_id: int, stop: int) -> str | None:
        """Why the graph's stored codes are not this cache's rows (at a few evenly spread
        live entries), or None: a graph mapped onto other entries would propose the wrong
        candidates."""
        for seq in np.unique(np.linspace(self._first_seq, stop - 1, 16).astype(np.int64)):
            stored = index.stored_vector(int(seq) - first_id + index.first_id)
            row = self._unit_rows_between(int(seq), int(seq) + 1)[0]
            norm = float(np.linalg.norm(stored))
            if norm == 0 or float(stored @ row) / norm < 0.99:
                return f"its entry {int(seq)} is not this cache's (cosine below 0.99)"
        return None

    def _wants_index(self) -> bool:
        return self.search == "auto" and self._size >= self.index_threshold

    def wait_for_index(self, timeout_s: float | None = None) -> bool:
        """Waits for background builds (one may start another); True when none runs any more."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._lock:
                thread = self._building
            if thread is None:
                return True
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            thread.join(remaining)
            if thread.is_alive():
                return False

    def run_audit(self, limit: int = 4) -> int:
        """Reruns up to `limit` sampled index answers with the exact scan (chunk by chunk, so
        queries go on meanwhile); counts the agreements. Returns how many were checked."""
        checked = 0
        while checked < limit:
            with self._lock:
                if not self._audit_queue:
                    break
                q, answered, next_seq = self._audit_queue.popleft()
                first = self._first_seq
            best = self._chunked_exact_max(q, first, next_seq)
            if best is None or best < answered - 1e-12:
                continue  # the answer's entry has left since: nothing to compare
            with self._lock:
                self.audits_total += 1
                if best <= answered + 1e-12:
                    self.audit_agreements_total += 1
            checked += 1
        return checked

    def _chunked_exact_max(self, q: Vector, first: int, stop: int) -> float | None:
        best: float | None = None
        seq = first
        while seq < stop:
            with self._lock:
                seq = max(seq, self._first_seq)
                end = min(stop, seq + _CHUNK, self._first_seq + self._size)
                if seq >= end:
                    break
                found = self._best(q, self._exact_candidates(q, seq, end))
            best = found.cosine if best is None else max(best, found.cosine)
            seq = end
        return best

    def _maintain_index(self) -> None:
        """After a change (under the lock): start a build when the memory is large enough, has
        outgrown the graph's sample, or the graph holds too many evicted entries; hand the
        tail to the feeder."""
        if self.search == "exact":
            return
        idle = self._building is None and not self._hold
        index = self._index
        if index is None:
            if self._size >= self.index_threshold and idle:
                self._start_build()
            return
        live = index.stop_id - self._first_seq
        if live <= 0 and index.stop_id < self._first_seq + self._size:
            # Every entry of the graph left before the feeder reached the next ones: it can
            # never be extended again (its ids are contiguous).
            self._index = None
            self._maintain_index()
            return
        dead = self._first_seq - index.first_id
        if idle and dead >= max(TAIL_BATCH, DEAD_PER_LIVE * live):
            if self._size < self.index_threshold:
                self._index = None  # small again: the exact scan serves
            else:
                self._start_build()
            return
        if idle and self._trained_on < _SAMPLE and self._size >= RETRAIN_GROWTH * self._trained_on:
            self._start_build()
            return
        waiting = self._first_seq + self._size - index.stop_id
        if waiting <= 0:
            return
        if not self._background:
            if waiting >= TAIL_BATCH:
                index.add(self._unit_rows_between(index.stop_id, index.stop_id + waiting))
            return
        if self._feeding:
            self._feed_wake.notify()
        else:
            self._feeding = True
            self._feeder = threading.Thread(target=self._feed, name="kp-cache-feed", daemon=True)
            self._feeder.start()

    def _feedable(self) -> AnnIndex | None:
        index = self._index
        if index is None or _EXITING.is_set():
            return None
        next_seq = self._first_seq + self._size
        return index if self._first_seq <= index.stop_id < next_seq else None

    def _feed(self) -> None:
        """The feeder thread: inserts the tail into the serving graph, FEED_BATCH entries per
        hold of the lock (no search runs on the graph meanwhile); ends when idle a while."""
        try:
            self._feed_until_idle()
        except BaseException:
            with self._lock:  # the next change starts a new feeder
                self._feeding = False
            raise

    def _feed_until_idle(self) -> None:
        one_core_for_this_thread()  # one core for background work, the rest for requests
        while True:
            with self._lock:
                index = self._feedable()
                while index is None:
                    notified = not _EXITING.is_set() and self._feed_wake.wait(_FEED_LINGER_S)
                    index = self._feedable()
                    if index is None and not notified:
                        self._feeding = False  # under the lock: the next change starts one
                        return
                start = index.stop_id
                stop = min(self._first_seq + self._size, start + FEED_BATCH)
                index.add(self._unit_rows_between(start, stop))
                sink = self.on_graph_built
                grown = index.stop_id - self._handed_stop >= HAND_ON_GROWTH * index.count
                if sink is not None and grown:
                    self._handed_stop = index.stop_id
                    lineage, first_id, count = self.lineage, index.first_id, index.count
            if sink is not None and grown:
                wanted = self.graph_wanted
                if wanted is None or wanted(first_id, count, lineage):
                    # Serialized outside the lock while searches go on: they only read the
                    # graph, and this thread is the only one that adds to a serving graph.
                    sink(BuiltGraph(index.to_bytes(), first_id, count, lineage))
            time.sleep(0)  # let a waiting request take the lock first

    def _start_build(self, seed: AnnIndex | None = None) -> None:
        generation = self._generation
        self._build_progress = 0.0
        if not self._background:
            self._build(generation, seed)
            return
        self._building = threading.Thread(
            target=self._build, args=(generation, seed), name="kp-cache-index", daemon=True
        )
        self._building.start()

    def _build(self, generation: int, seed: AnnIndex | None = None) -> None:
        try:
            self._build_graph(generation, seed)
        finally:
            with self._lock:  # also after an error: the next change may start a build
                if self._building is threading.current_thread():
                    self._building = None

    def _build_graph(self, generation: int, seed: AnnIndex | None = None) -> None:
        """Trains a new graph's codes on a sample of the newest entries, then inserts every
        live entry, a chunk at a time, outside the lock (the graph is private until done); it
        replaces the serving one once it has caught up, and the triggers are checked again.
        `seed`: an adopted graph, still private, that only needs the entries after it (not
        a build: not counted as one, and handed to the owner only if it grew by a batch)."""
        if self._ever_indexed:
            # A rebuild while a graph serves: one core, the others stay for requests. The
            # first build (a start, warming, not ready) uses every core.
            one_core_for_this_thread()
        index: AnnIndex | None = seed
        seed_stop = -1 if seed is None else seed.stop_id
        sample: CacheEntries | None = None
        # For the owner (on_graph_built): serialized once caught up, while still private,
        # so the serving graph is never copied under the lock.
        data: bytes | bytearray | None = None
        built: BuiltGraph | None = None
        while True:
            with self._lock:
                if generation != self._generation or _EXITING.is_set():
                    return
                first, stop = self._first_seq, self._first_seq + self._size
                outgrown = sample is not None and (
                    len(sample.vectors) < _SAMPLE
                    and self._size >= RETRAIN_GROWTH * len(sample.vectors)
                )
                if index is None or outgrown or index.stop_id < first:
                    # A new graph: the first, or the memory outgrew the sample (train on a
                    # larger one), or every entry it holds was evicted meanwhile.
                    index, data = None, None
                else:
                    seq = index.stop_id
                    caught_up = stop - seq < TAIL_BATCH or data is not None
                    sink = self.on_graph_built
                    if index is seed and seq - seed_stop < TAIL_BATCH:
                        sink = None  # as adopted: its owner has it already
                    if caught_up and (sink is None or data is not None):
                        # The rest goes to the feeder.
                        self._index = index
                        self._ever_indexed = True
                        self._build_progress = 1.0
                        if index is not seed:
                            self.index_builds_total += 1
                        if self._building is threading.current_thread():
                            self._building = None
                        if sink is not None and data is not None:
                            built = BuiltGraph(data, index.first_id, index.count, self.lineage)
                            self._handed_stop = index.stop_id
                        self._maintain_index()
                        break
                    if not caught_up:
                        end = min(stop, seq + _CHUNK)
                        rows = self._unit_rows_between(seq, end)
                        # Never back: a build that starts over on a larger sample (or a
                        # memory that grows while it builds) keeps the share it reported.
                        self._build_progress = max(
                            self._build_progress, (seq - first) / max(1, self._size)
                        )
            if index is None:
                if sample is None or outgrown:
                    sample = self.entries_between(max(first, stop - _SAMPLE), stop)
                    with self._lock:
                        self._trained_on = max(self._trained_on, len(sample.vectors))
                index = AnnIndex(self.dimensions, first, self._index_params)
                index.train(_unit_rows(sample.vectors, None))
                continue
            if caught_up:
                data = index.to_bytes()
                continue
            index.add(rows)
        if built is not None and sink is not None:
            sink(built)

    def _unit_rows_between(self, start_seq: int, stop_seq: int) -> npt.NDArray[np.float32]:
        slots = self._slots(start_seq, stop_seq)
        return _unit_rows(self._vectors[slots], self._norms[slots])

    def _reset_index(self) -> None:
        self._generation += 1
        self.lineage = uuid.uuid4().hex
        self._trained_on = 0
        self._index = None
        self._building = None  # a build of the old generation ends at its next chunk
        self._audit_queue.clear()

    # ── internals ───────────────────────────────────────────────────────────

    def _as_vector(self, vector: npt.ArrayLike) -> Vector:
        v = np.asarray(vector, dtype=np.float32)
        if v.ndim != 1 or v.shape[0] != self.dimensions:
            raise ValueError(
                f"expected a vector of {self.dimensions} dimensions, got shape {v.shape}"
            )
        if not np.isfinite(v).all():
            raise ValueError("vector has non-finite values")
        return v

    def _slots(self, start_seq: int, stop_seq: int) -> npt.NDArray[np.intp]:
        offsets = np.arange(start_seq - self._first_seq, stop_seq - self._first_seq)
        return (self._head + offsets) % max(1, len(self._vectors))

    def _exact_candidates(self, q: Vector, start_seq: int, stop_seq: int) -> npt.NDArray[np.int64]:
        """Sequence numbers in [start, stop) whose float32 cosine can be the maximum."""
        if start_seq >= stop_seq:
            return np.empty(0, dtype=np.int64)
        length = len(self._vectors)
        if stop_seq - start_seq == length:
            # Every row (a full ring, the common case): one product over the whole array
            # instead of one per run and their concatenation.
            scores = self._vectors @ q
            slots = np.flatnonzero(scores >= float(scores.max()) - _RESCORE_MARGIN)
            return (start_seq + (slots - self._row(start_seq)) % length).astype(np.int64)
        parts = []
        for seq, row_start, row_stop in self._runs(start_seq, stop_seq):
            parts.append((seq, self._vectors[row_start:row_stop] @ q))
        best = max(float(p.max()) for _, p in parts)
        return np.concatenate(
            [seq + np.flatnonzero(p >= best - _RESCORE_MARGIN) for seq, p in parts]
        ).astype(np.int64)

    def _row(self, seq: int) -> int:
        """The row of the ring that holds the live entry `seq`."""
        return (self._head + seq - self._first_seq) % len(self._vectors)

    def _runs(self, start_seq: int, stop_seq: int) -> list[tuple[int, int, int]]:
        """[start, stop) as at most two contiguous runs of rows: (first seq, row start, stop)."""
        length = len(self._vectors)
        row = self._row(start_seq)
        count = stop_seq - start_seq
        if row + count <= length:
            return [(start_seq, row, row + count)]
        first = length - row
        return [(start_seq, row, length), (start_seq + first, 0, count - first)]

    def _best(self, q: Vector, seqs: npt.NDArray[np.int64]) -> Nearest:
        """The exact (float64) best of the given entries; ties go to the newest."""
        if len(seqs) > 1:
            seqs = np.unique(seqs)  # sorted: the newest last
        slots = (self._head + (seqs - self._first_seq)) % len(self._vectors)
        q64 = q.astype(np.float64)
        q_norm = _norm64(q)
        # Row by row in the same summation order as exact_cosine, whatever the row count.
        dots = (self._vectors[slots].astype(np.float64) * q64).sum(axis=1)
        denominators = self._norms[slots] * q_norm
        cosines = np.divide(dots, denominators, out=np.zeros_like(dots), where=denominators != 0)
        # The newest of the maximal ones: the last index of the maximum.
        at = len(cosines) - 1 - int(np.argmax(cosines[::-1]))
        slot = int(slots[at])
        # The reference starts its running maximum at -1.
        return Nearest(
            max(-1.0, float(cosines[at])),
            str(self._trace_ids[slot]),
            float(self._added_at[slot]),
        )

    def _grow(self) -> None:
        new_len = min(self.capacity, max(64, 2 * len(self._vectors)))
        order = self._ordered_indices()
        vectors = np.empty((new_len, self.dimensions), dtype=np.float32)
        norms = np.empty(new_len, dtype=np.float64)
        added = np.empty(new_len, dtype=np.float64)
        ids = np.empty(new_len, dtype=object)
        vectors[: self._size] = self._vectors[order]
        norms[: self._size] = self._norms[order]
        added[: self._size] = self._added_at[order]
        ids[: self._size] = self._trace_ids[order]
        self._vectors, self._norms, self._added_at, self._trace_ids = vectors, norms, added, ids
        self._head = 0

    def _tail_index(self) -> int:
        return (self._head + self._size - 1) % len(self._vectors)

    def _ordered_indices(self) -> npt.NDArray[np.intp]:
        return (self._head + np.arange(self._size)) % max(1, len(self._vectors))

    def _drop_expired(self) -> None:
        if self.ttl_ms is None or self._size == 0:
            return
        cutoff = self._clock_ms() - self.ttl_ms
        if self._added_at[self._head] > cutoff:
            return
        # The reference keeps entries with addedAt > cutoff; times are ordered, so the expired
        # ones are a prefix (found run by run: no copy of a large ring).
        expired = 0
        for _, start, stop in self._runs(self._first_seq, self._first_seq + self._size):
            run = int(np.searchsorted(self._added_at[start:stop], cutoff, side="right"))
            expired += run
            if run < stop - start:
                break
        if expired:
            self._head = (self._head + expired) % len(self._vectors)
            self._size -= expired
            self._first_seq += expired
            self._maintain_index()


def exact_cosine(a: Vector, b: Vector) -> float:
    """The cosine of two vectors in float64, as the cache rescores (0 for a zero vector)."""
    denominator = _norm64(b) * _norm64(a)
    dot = float((b.astype(np.float64) * a.astype(np.float64)).sum())
    return 0.0 if denominator == 0 else max(-1.0, dot / denominator)


def _row_norms(rows: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    """Each row's norm as _norm64 computes it, a block at a time (no float64 copy of all)."""
    out = np.empty(len(rows), dtype=np.float64)
    for start in range(0, len(rows), _CHUNK):
        wide = rows[start : start + _CHUNK].astype(np.float64)
        out[start : start + _CHUNK] = np.sqrt((wide * wide).sum(axis=1))
    return out


def _norm64(v: Vector) -> float:
    wide = v.astype(np.float64)
    return float(np.sqrt((wide * wide).sum()))


def _unit(v: Vector) -> Vector:
    norm = float(np.linalg.norm(v))
    return v if norm == 0 else (v / norm).astype(np.float32)


def _unit_rows(
    rows: npt.NDArray[np.float32], norms: npt.NDArray[np.float64] | None
) -> npt.NDArray[np.float32]:
    if norms is None:
        norms = np.linalg.norm(rows.astype(np.float64), axis=1)
    safe = np.where(norms == 0, 1.0, norms)
    return (rows / safe[:, None]).astype(np.float32)
