"""The novelty memory at size: the domain's ring and exact scan (app.domain.vector_cache)
with an approximate index, and the threads that build, feed and check it
(docs/operating/large-memory.md).

At or above `index_threshold` entries (search="auto") an HNSW graph (app.store.ann_index)
proposes candidates (a second, wider search when the best of them is far: the graph's weak
case) and the domain's float64 rescoring picks among them, so `max_cosine` is always a true
cosine with a stored vector. Below it, or with search="exact", the exact scan answers.
Where the score turns the answer is exact whichever path: an index answer of CONFIRM_FROM or
more is answered by the exact scan (unless its entry is the query's own vector), and ties go
to the newest copy on both paths. Every answer says how it was found (Nearest.search).
That scan reads only the entries whose cosine bound (app.store.cosine_bounds) can reach the
cosine the index found, and the newest entries the bounds lack: the full scan's answer for
about a tenth of its cost. The bounds are made with the index (their basis fitted, the
entries bounded, in a background thread; the full scan confirms meanwhile) and follow the
memory a batch at a time.

No graph insert is on the request path: the graph is built in a background thread on a copy
of the rows (the exact scan answers meanwhile), and the newest entries wait in a tail, scanned
exactly, until a second background thread (the feeder) inserts them a few at a time under the
lock, so no search ever runs on a graph being added to. Evicted and expired entries are
excluded from every search at once by the id range; once they are a third of the graph, a new
graph is built on the live entries in the background and replaces the old one whole.

A graph built elsewhere (beside a snapshot, published by another replica) can be adopted
instead of built (`adopt_index`, checked against the rows; the entries newer than it are
inserted as a build's are before it serves); each graph built here is handed, serialized while
still private, to the owner (`on_graph_built`) to keep or share, and so is the serving graph
each time the feeder has grown it by a tenth.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import numpy.typing as npt

from app.domain.vector_cache import (
    Nearest,
    Vector,
    VectorCache,
    norm64,
    unit,
    unit_rows,
    wall_clock_ms,
)
from app.store.ann_index import DEFAULT_PARAMS, AnnIndex, one_core_for_this_thread
from app.store.cosine_bounds import DEFAULT_TIERS, FIT_SAMPLE, CosineBounds, fit_basis

SearchMode = Literal["exact", "auto"]
IndexState = Literal["off", "building", "ready"]

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
#: The newest entries the cosine bounds lack (scanned exactly meanwhile) are bounded in one go
#: once they are this many (about 0.2 ms on the add that reaches it, one core); a backlog
#: larger than BOUND_INLINE (0.8 ms: a replica's page of the log, a build) is left to a
#: background thread.
BOUND_BATCH = 64
BOUND_INLINE = 256
#: An idle feeder waits this long for new entries before its thread ends.
_FEED_LINGER_S = 5.0
#: A new graph replaces the serving one when the evicted entries it still holds reach this
#: share of its live ones (the graph's memory stays under 1.5 x the capacity's).
DEAD_PER_LIVE = 0.5
#: Rows the background work inserts or scans under the lock at a time, so a request never
#: waits for more than about a millisecond of it.
_CHUNK = 4_096

#: Set at interpreter exit (stop_background_work): graph builds and feeders stop at their
#: next step.
_EXITING = threading.Event()
#: Every cache, for stop_background_work (weakly: a cache no one holds is let go).
_CACHES: weakref.WeakSet[IndexedCache] = weakref.WeakSet()
#: How long exit waits for one background thread's current step (a chunk of a build, a
#: graph's serialization: seconds at a million entries).
_EXIT_JOIN_S = 60.0


@atexit.register
def stop_background_work() -> None:
    """The interpreter's finalization unwinds a daemon thread that is inside faiss (a build,
    the feeder) through OpenMP's frames, which aborts the process ("terminate called without
    an active exception", exit status 134): at exit they stop at their next step and are
    waited for first. The service's launcher calls it before it ends the process itself
    (app/serve.py), so that a graph being written beside the snapshot is finished."""
    _EXITING.set()
    threads: list[threading.Thread] = []
    for cache in list(_CACHES):
        with cache._lock:  # taken once the feeder's current insert is done
            cache._feed_wake.notify_all()
            threads += [
                t for t in (cache._building, cache._feeder, cache._bounder) if t is not None
            ]
    for thread in threads:
        thread.join(_EXIT_JOIN_S)


#: A true maximum cosine from here on makes a near-duplicate: novelty falls to almost nothing
#: and the score turns (docs/decisions/large-memory-search.md).
NEAR_DUPLICATE = 0.9
#: How far below the exact maximum an index answer may be (the bound bench.memory checks at
#: size: within 0.02 for 99.9% of fresh traces, never more than this).
INDEX_BOUND = 0.05
#: An index answer this high is confirmed by the exact scan: a trace whose true maximum is a
#: near-duplicate's has an index answer at most INDEX_BOUND below it, so it is always
#: answered exactly.
CONFIRM_FROM = NEAR_DUPLICATE - INDEX_BOUND

#: One index query in this many is rerun exactly in the background (the self-check).
AUDIT_EVERY = 100
#: The graph is built again (in the background) when the memory has grown to this many times
#: the entries its codes were trained on (every live entry at the time): from the threshold's
#: 20,000, at 80,000 and 320,000, so a graph's codes always come from at least a quarter of
#: the memory (and from all of it after the rebuild eviction brings: DEAD_PER_LIVE).
RETRAIN_GROWTH = 4
_AUDIT_QUEUE = 64


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
    confirmations_total: int = 0  # index answers at or above CONFIRM_FROM rescanned exactly
    trained_on: int = 0  # entries the serving graph's codes were trained on
    bounded: int = 0  # entries the cosine bounds cover (0: a confirmation reads every one)
    bound_fits_total: int = 0  # bases fitted (bounds made) since start
    full_scan_confirmations_total: int = 0  # confirmations that read every entry: no bounds yet


@dataclass(frozen=True, slots=True)
class BuiltGraph:
    """A graph this cache just built and swapped in, or its serving graph grown by the
    feeder, serialized (AnnIndex.to_bytes) for its owner to keep or share: its internal id 0
    is the entry `first_seq` of `lineage`."""

    data: bytes | bytearray
    first_seq: int
    count: int
    lineage: str


class IndexedCache(VectorCache):
    """A thread-safe VectorCache with an approximate index past a threshold (module
    docstring)."""

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
        bound_tiers: tuple[int, int] = DEFAULT_TIERS,
    ) -> None:
        if index_threshold < 1:
            raise ValueError("index_threshold must be at least 1")
        if index_ef_search < 1:
            raise ValueError("index_ef_search must be at least 1")
        if index_ef_search_far < 0:
            raise ValueError("index_ef_search_far must be 0 (off) or positive")
        lock = threading.RLock()  # the background threads share the rows with requests
        super().__init__(capacity, dimensions, ttl_ms, clock_ms, lock=lock)
        self.search = search
        self.index_threshold = index_threshold
        self._index_params = replace(
            DEFAULT_PARAMS, ef_search=index_ef_search, ef_search_far=index_ef_search_far
        )
        self._background = background
        # The serving graph: the live entries with seq < _index.stop_id are in it.
        self._index: AnnIndex | None = None
        self._building: threading.Thread | None = None
        self._feeding = False  # the feeder thread runs
        self._feeder: threading.Thread | None = None
        _CACHES.add(self)
        self._feed_wake = threading.Condition(lock)
        self._build_progress = 0.0
        self._generation = 0  # changes with clear/load: a build of an older one is dropped
        # Set once an index has served: later builds (after a clear, past the threshold
        # again) happen while the exact scan answers and do not make the service unready.
        self._ever_indexed = False
        self._trained_on = 0  # the live entries the graph's codes were trained on
        self._queries = 0
        self.far_searches_total = 0  # index answers that took the second, wider search
        self.confirmations_total = 0  # index answers confirmed by the exact scan
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
        # The cosine bounds of the exact confirmation (cosine_bounds), made with the index: the
        # live entries bounds.start <= seq < bounds.stop have them, the newer ones are scanned.
        self._bound_tiers = (min(bound_tiers[0], dimensions), min(bound_tiers[1], dimensions))
        self._bounds: CosineBounds | None = None
        self._bounder: threading.Thread | None = None  # fits and catches the bounds up
        self.bound_fits_total = 0  # bases fitted (bounds made) since start
        self.full_scan_confirmations_total = 0  # confirmations made before the bounds were

    # ── the hooks of VectorCache ────────────────────────────────────────────

    def _search(self, q: Vector, first: int, next_seq: int) -> Nearest:
        """The exact scan below the threshold; else the graph's candidates, rescored exactly,
        with the exact scan's answer instead when they come near a near-duplicate (the score
        turns there), and ties resolved as the exact scan does (the newest)."""
        if self._index is None:
            return super()._search(q, first, next_seq)
        tail_from = max(first, self._index.stop_id)
        direction = unit(q)
        proposed = self._index.search(direction, first)
        candidates = np.concatenate([proposed, self._exact_candidates(q, tail_from, next_seq)])
        if len(candidates) == 0:  # the graph held no live entry it could reach
            candidates = self._exact_candidates(q, first, next_seq)
        found, seq = self._best_at(q, candidates)
        params = self._index.params
        if found.cosine < params.far_below and params.ef_search_far > params.ef_search:
            # Far from everything found: the graph's weak case (ann_index.DEFAULT_PARAMS).
            self.far_searches_total += 1
            wider = self._index.search(direction, first, params.ef_search_far)
            found, seq = self._best_at(q, np.concatenate([candidates, wider]))
        resubmitted = found.cosine >= CONFIRM_FROM and np.array_equal(
            self._vectors[self._row(seq)], q
        )
        if found.cosine >= CONFIRM_FROM and not resubmitted:
            # Where the score turns: the exact answer (ties to the newest included).
            self.confirmations_total += 1
            return self._exact_from(q, first, next_seq, found.cosine)
        copies = self._copies_after(seq, next_seq)
        if len(copies):  # the same vector stored again later: ties go to the newest
            found = self._best(q, np.concatenate([[seq], copies]))
        if resubmitted:
            # The trace is stored already: nothing is closer to a vector than itself, and its
            # later copies were looked up: the exact answer, no scan.
            return found
        self._queries += 1
        if self._queries % AUDIT_EVERY == 0:
            self._audit_queue.append((q.copy(), found.cosine, next_seq))
        return replace(found, search="index", bound=INDEX_BOUND)

    def _changed(self) -> None:
        self._maintain_index()
        self._maintain_bounds()

    def _reset(self) -> None:
        self._generation += 1
        self._trained_on = 0
        self._index = None
        self._bounds = None
        self._building = None  # a build of the old generation ends at its next chunk
        self._audit_queue.clear()

    def _extra_memory_bytes(self) -> int:
        graph = self._index.memory_bytes if self._index is not None else 0
        return graph + (self._bounds.memory_bytes if self._bounds is not None else 0)

    # ── the exact scan, pruned by cosine bounds ─────────────────────────────

    def nearest_from(
        self, query: npt.ArrayLike, lower: float, skip_oldest: int = 0
    ) -> Nearest | None:
        """The exact `nearest` (VectorCache.nearest), given `lower`: a cosine some entry it
        searches has with `query` (the answer's is at least that). Reads only the entries
        whose bound can reach it, and the newest ones the bounds lack: the full scan's
        answer, found in a fraction of its reads."""
        q = self._as_vector(query)
        with self._lock:
            first, next_seq = self._searched_range(skip_oldest)
            return None if first >= next_seq else self._exact_from(q, first, next_seq, lower)

    def _exact_from(self, q: Vector, first: int, next_seq: int, lower: float) -> Nearest:
        """The exact best of first <= seq < next_seq (under the lock), `lower` being a cosine
        one of them has: entries with bounds below it cannot be the best and are skipped."""
        bounds = self._bounds
        if bounds is None:
            self.full_scan_confirmations_total += 1
            return super()._search(q, first, next_seq)
        low, high = max(first, bounds.start), min(next_seq, bounds.stop)
        seqs = []
        if low < high:
            norm = norm64(q)
            if norm == 0:
                return super()._search(q, first, next_seq)
            seqs.append(bounds.candidates(q.astype(np.float64) / norm, low, high, lower))
        else:
            low = high = next_seq
        # Entries the bounds lack: the newest (the tail), or, before any, none in practice.
        if first < low:
            seqs.append(self._exact_candidates(q, first, low))
        if high < next_seq:
            seqs.append(self._exact_candidates(q, max(first, high), next_seq))
        candidates = np.concatenate(seqs) if seqs else np.empty(0, dtype=np.int64)
        if len(candidates) == 0:  # `lower` was no live entry's cosine
            return super()._search(q, first, next_seq)
        return self._best(q, candidates)

    def bounded_range(self) -> tuple[int, int] | None:
        """(start, stop): the sequence numbers the cosine bounds cover, None when there are
        none (for tests and operators)."""
        with self._lock:
            bounds = self._bounds
            return None if bounds is None else (bounds.start, bounds.stop)

    def _maintain_bounds(self) -> None:
        """After a change (under the lock): forget the departed entries' bounds; bound the
        newest once they are a batch (here when few, else in the background); fit a basis in
        the background when the index is first wanted, and again when the memory has outgrown
        the one it has (_refit_due)."""
        bounds = self._bounds
        if bounds is not None:
            bounds.drop_before(self._first_seq)
        refit = self._wants_index() and (bounds is None or self._refit_due(bounds))
        if (bounds is None and not refit) or self._bounder is not None:
            return  # nothing wanted, or the background thread catches up
        next_seq = self._first_seq + self._size
        lag = next_seq - (bounds.stop if bounds is not None else self._first_seq)
        if not refit and lag < BOUND_BATCH:
            return
        if bounds is not None and not refit and (lag <= BOUND_INLINE or not self._background):
            slots = self._slots(bounds.stop, next_seq)
            bounds.extend(self._vectors[slots], self._norms[slots])
            return
        if not self._background:
            self._bounds = self._fitted_bounds(self._fit_sample())
            self.bound_fits_total += 1
            self._maintain_bounds()
            return
        if _EXITING.is_set():
            return
        self._bounder = threading.Thread(
            target=self._bound, args=(refit,), name="kp-cache-bounds", daemon=True
        )
        self._bounder.start()

    def _refit_due(self, bounds: CosineBounds) -> bool:
        """The basis came from entries that have all left, or from a memory a quarter of
        this one's size or less (as the graph's codes: RETRAIN_GROWTH). A stale basis still
        gives true bounds, only looser ones."""
        return (
            self._first_seq >= bounds.fitted_stop or self._size >= RETRAIN_GROWTH * bounds.fitted_on
        )

    def _fit_sample(self) -> tuple[npt.NDArray[np.float64], int, int]:
        """Up to FIT_SAMPLE live entries evenly spread, as unit rows (copied under the lock:
        a few milliseconds), with the first sequence number and the size they come from."""
        seqs = np.unique(
            np.linspace(self._first_seq, self._first_seq + self._size - 1, FIT_SAMPLE).astype(
                np.int64
            )
        )
        return self._unit_rows_of(seqs), self._first_seq, self._size

    def _fitted_bounds(self, fit: tuple[npt.NDArray[np.float64], int, int]) -> CosineBounds:
        sample, first, size = fit
        return CosineBounds(
            fit_basis(sample, self._bound_tiers[1]),
            first,
            self._bound_tiers,
            fitted_stop=first + size,
            fitted_on=size,
        )

    def _bound(self, refit: bool) -> None:
        """The bounds thread: fits a new basis when `refit`, then bounds the entries that
        lack them a chunk at a time, computed outside the lock; ends when caught up. A new
        basis's bounds are private until caught up, the old ones serving meanwhile."""
        try:
            self._bound_until_caught_up(refit)
        finally:
            with self._lock:
                if self._bounder is threading.current_thread():
                    self._bounder = None
                    self._maintain_bounds()  # what a clear or load meanwhile left due

    def _bound_until_caught_up(self, refit: bool) -> None:
        with self._lock:
            generation = self._generation
            if self._size == 0:
                return
            fit = self._fit_sample() if refit or self._bounds is None else None
            bounds = self._bounds
        if fit is not None:
            bounds = self._fitted_bounds(fit)
        while bounds is not None and not _EXITING.is_set():
            with self._lock:
                if generation != self._generation:
                    return
                bounds.drop_before(self._first_seq)
                start, next_seq = bounds.stop, self._first_seq + self._size
                if next_seq - start < BOUND_BATCH:
                    if bounds is not self._bounds:
                        self._bounds = bounds
                        self.bound_fits_total += 1
                    self._bounder = None  # caught up: _maintain_bounds takes over
                    return
                stop = min(next_seq, start + _CHUNK)
                slots = self._slots(start, stop)
                rows, norms = self._vectors[slots], self._norms[slots]
            projected = bounds.project(rows, norms)
            with self._lock:
                if generation == self._generation and bounds.stop == start:
                    bounds.append(projected)
            time.sleep(0)  # let a waiting request take the lock first

    def _unit_rows_of(self, seqs: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
        slots = self._rows_of(seqs)
        rows = self._vectors[slots].astype(np.float64)
        norms = self._norms[slots]
        return rows / np.where(norms == 0, 1.0, norms)[:, None]

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
                confirmations_total=self.confirmations_total,
                trained_on=self._trained_on if self._index is not None else 0,
                bounded=self._bounded(),
                bound_fits_total=self.bound_fits_total,
                full_scan_confirmations_total=self.full_scan_confirmations_total,
            )

    def _bounded(self) -> int:
        """The live entries the cosine bounds cover (under the lock)."""
        if self._bounds is None:
            return 0
        low = max(self._bounds.start, self._first_seq)
        return max(0, min(self._bounds.stop, self._first_seq + self._size) - low)

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
            self._trained_on = index.count
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

    def serving_graph(self) -> BuiltGraph | None:
        """The serving graph serialized now, under the lock (seconds at a million entries, while
        queries wait): for tools and benches. A serving cache hands its graphs on through
        on_graph_built instead, never under the lock."""
        with self._lock:
            index = self._index
            if index is None:
                return None
            return BuiltGraph(index.to_bytes(), index.first_id, index.count, self.lineage)

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
        outgrown what the graph was trained on, or the graph holds too many evicted entries;
        hand the tail to the feeder."""
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
        if idle and self._size >= RETRAIN_GROWTH * self._trained_on:
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
        """Trains a new graph's codes on every live entry (_code_ranges), then inserts every
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
        trained = 0  # the live entries the new graph's codes were trained on (0: none yet)
        # For the owner (on_graph_built): serialized once caught up, while still private,
        # so the serving graph is never copied under the lock.
        data: bytes | bytearray | None = None
        built: BuiltGraph | None = None
        while True:
            with self._lock:
                if generation != self._generation or _EXITING.is_set():
                    return
                first, stop = self._first_seq, self._first_seq + self._size
                outgrown = trained > 0 and self._size >= RETRAIN_GROWTH * trained
                if index is None or outgrown or index.stop_id < first:
                    # A new graph: the first, or the memory outgrew its training (train on a
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
                        # Never back: a build that starts over on a larger memory (or a
                        # memory that grows while it builds) keeps the share it reported.
                        self._build_progress = max(
                            self._build_progress, (seq - first) / max(1, self._size)
                        )
            if index is None:
                if trained == 0 or outgrown:
                    low, high, trained = self._code_ranges()
                    if trained == 0:  # cleared meanwhile: the next change starts what is due
                        return
                    with self._lock:
                        self._trained_on = trained
                index = AnnIndex(self.dimensions, first, self._index_params)
                # The codes' per-dimension ranges (faiss's min-max training): the minimum and
                # the maximum of every live entry train them exactly as the entries would.
                index.train(np.stack([low, high]))
                continue
            if caught_up:
                data = index.to_bytes()
                continue
            index.add(rows)
        if built is not None and sink is not None:
            sink(built)

    def _code_ranges(self) -> tuple[Vector, Vector, int]:
        """Each dimension's minimum and maximum over the live entries' unit vectors, a chunk at
        a time under the lock (no copy of the memory), and how many entries they cover."""
        low = np.full(self.dimensions, np.inf, dtype=np.float32)
        high = np.full(self.dimensions, -np.inf, dtype=np.float32)
        with self._lock:
            seq, counted = self._first_seq, 0
        while True:
            with self._lock:
                seq = max(seq, self._first_seq)
                end = min(self._first_seq + self._size, seq + _CHUNK)
                if seq >= end:
                    break
                rows = self._unit_rows_between(seq, end)
            np.minimum(low, rows.min(axis=0), out=low)
            np.maximum(high, rows.max(axis=0), out=high)
            counted += end - seq
            seq = end
        return low, high, counted

    def _unit_rows_between(self, start_seq: int, stop_seq: int) -> npt.NDArray[np.float32]:
        slots = self._slots(start_seq, stop_seq)
        return unit_rows(self._vectors[slots], self._norms[slots])
