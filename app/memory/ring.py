"""The memory novelty is measured against (docs/scoring.md, novelty): a bounded ring of float32
rows (adding never moves data, eviction is oldest first, entries older than the TTL leave as a
prefix), each with a sequence number and a trace id, and its exact search: one matrix-vector
product of cosines (each row over its norm, so that a long row cannot crowd out the true
nearest), then the few rows that can be the maximum rescored in float64, so that the result
equals the reference's double-precision loop whatever the rows' lengths (ties: the newest).
Pure: no threads, no I/O; a cache shared between threads is given a lock (`lock=`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

Vector = npt.NDArray[np.float32]

# float32 dot products of unit vectors are within ~1e-6 of the exact value; every row this close
# to the float32 maximum is rescored exactly.
_RESCORE_MARGIN = 1e-4
#: Rows copied or scanned under the lock at a time, so a request never waits for more than
#: about a millisecond of a large copy.
CHUNK = 4_096


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
class CacheEntries:
    """The cached vectors oldest first, with the wall-clock time (ms) each was added and the
    trace id it came from ('' when unknown)."""

    vectors: npt.NDArray[np.float32]
    added_at_ms: npt.NDArray[np.float64]
    trace_ids: Sequence[str] = ()

    def ids(self) -> Sequence[str]:
        return self.trace_ids if len(self.trace_ids) else [""] * len(self.vectors)


class VectorCache:
    """A bounded store of vectors with maximum-cosine search (module docstring). Thread-safe
    when given a reentrant lock that every user of it shares."""

    def __init__(
        self,
        capacity: int = 1000,
        dimensions: int = 384,
        ttl_ms: float | None = None,
        clock_ms: Callable[[], float] = wall_clock_ms,
        *,
        lock: AbstractContextManager[Any] | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        if dimensions < 1:
            raise ValueError("dimensions must be at least 1")
        if ttl_ms is not None and ttl_ms <= 0:
            raise ValueError("ttl_ms must be positive")
        self.capacity = capacity
        self.dimensions = dimensions
        self.ttl_ms = ttl_ms
        #: The cache's clock (ages are measured on it).
        self.now_ms = clock_ms
        # Reentrant (the memory holds it around calls into the cache); a no-op for one thread.
        self._lock: AbstractContextManager[Any] = contextlib.nullcontext() if lock is None else lock
        # Rows are allocated as the cache grows, so a large capacity costs nothing up front.
        self._vectors = np.empty((0, dimensions), dtype=np.float32)
        self._norms = np.empty(0, dtype=np.float64)
        self._added_at = np.empty(0, dtype=np.float64)
        self._trace_ids = np.empty(0, dtype=object)
        self._head = 0  # slot of the oldest entry
        self._prefaulted = 0  # rows of the ring written since its allocation (prefault)
        self._size = 0
        self._first_seq = 0  # sequence number of the oldest entry
        self.adds_total = 0
        self.evictions_total = 0

    # ── queries ─────────────────────────────────────────────────────────────

    @property
    def size(self) -> int:
        with self._lock:
            self._drop_expired()
            return self._size

    def nearest(self, query: npt.ArrayLike, skip_oldest: int = 0) -> Nearest | None:
        """The entry with the largest cosine to `query` (ties: the newest); None when empty.
        `skip_oldest`: leave out that many of the oldest entries (those a dry run's earlier
        traces would have evicted)."""
        q = self._as_vector(query)
        with self._lock:
            self._drop_expired()
            first, stop = self._first_seq + max(0, skip_oldest), self._first_seq + self._size
            return None if first >= stop else self._best(q, self._candidates(q, first, stop))

    def stats(self) -> CacheStats:
        with self._lock:
            self._drop_expired()
            now = self.now_ms()
            return CacheStats(
                size=self._size,
                capacity=self.capacity,
                dimensions=self.dimensions,
                ttl_ms=self.ttl_ms,
                memory_bytes=sum(a.nbytes for a in self._arrays()),
                oldest_age_ms=float(now - self._added_at[self._head]) if self._size else None,
                newest_age_ms=(
                    float(now - self._added_at[self._rows_of(self._first_seq + self._size - 1)])
                    if self._size
                    else None
                ),
                adds_total=self.adds_total,
                evictions_total=self.evictions_total,
            )

    def chunks(self) -> Iterator[CacheEntries]:
        """The live entries oldest first, a copy of CHUNK at a time (for exports), the lock
        released between copies so that a large export does not hold up queries; entries
        evicted meanwhile are left out, entries added meanwhile are not included."""
        with self._lock:
            self._drop_expired()
            seq, stop = self._first_seq, self._first_seq + self._size
        while seq < stop:
            with self._lock:
                self._drop_expired()
                rows = self._rows_of(np.arange(max(seq, self._first_seq), min(seq + CHUNK, stop)))
                chunk = CacheEntries(
                    self._vectors[rows], self._added_at[rows], self._trace_ids[rows].tolist()
                )
            seq += CHUNK
            if len(rows):
                yield chunk

    # ── updates ─────────────────────────────────────────────────────────────

    def add(self, vector: npt.ArrayLike, trace_id: str = "") -> None:
        """Append a vector, added now; the oldest entry goes when the cache is over capacity."""
        self.extend(self._as_vector(vector)[None], np.array([self.now_ms()]), [trace_id])

    def extend(
        self,
        vectors: npt.NDArray[np.float32],
        added_at_ms: npt.NDArray[np.float64],
        trace_ids: Sequence[str],
    ) -> None:
        """`add` for many vectors at once, each with its time (a start's load, a committed
        group of traces, an import): the same entries, times, evictions and counts as adding
        them one by one at those times, in one copy."""
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
                # Insertion times kept ordered, so that expiry is always a prefix of the ring.
                newest = self._added_at[(self._head + self._size - 1) % len(self._vectors)]
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
            start = (self._head + self._size) % len(self._vectors)
            slots: slice | npt.NDArray[np.intp] = (
                # One run of rows (a load into a reserved ring): copied as slices.
                slice(start, start + len(v))
                if start + len(v) <= len(self._vectors)
                else (start + np.arange(len(v))) % len(self._vectors)
            )
            self._vectors[slots] = v
            self._norms[slots] = _row_norms(v)
            self._added_at[slots] = times
            self._trace_ids[slots] = ids
            self._size += len(v)
            self.adds_total += n

    def reserve(self, rows: int) -> None:
        """Room for `rows` entries (at most the capacity) in one allocation, so that loading
        that many does not grow the ring a doubling at a time."""
        with self._lock:
            if len(self._vectors) < min(self.capacity, rows):
                self._grow(min(self.capacity, rows))

    def prefault(self, rows: int = CHUNK) -> bool:
        """Writes zeros into up to `rows` free rows of the ring past the newest entry, so that
        a large load's copies find their memory mapped (the first write to a fresh allocation
        costs a page fault a page: seconds for a gigabyte on some hosts); a thread beside the
        load calls it while the load reads. False when no free row is left past the newest
        entry (a ring that wraps is never touched: its free rows are few)."""
        with self._lock:
            length = len(self._vectors)
            start = max(self._prefaulted, self._head + self._size)
            if self._head + self._size > length or start >= length:
                return False
            stop = min(length, start + rows)
            self._vectors[start:stop] = 0
            self._prefaulted = stop
            return stop < length

    def clear(self) -> int:
        """Empty the cache; returns how many vectors were dropped."""
        with self._lock:
            dropped = self._size
            self._first_seq += self._size
            self._head = 0
            self._size = 0
            return dropped

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

    def _candidates(self, q: Vector, start_seq: int, stop_seq: int) -> npt.NDArray[np.int64]:
        """Sequence numbers in [start, stop) whose float32 cosine can be the maximum.

        Rows are ranked by cosine (their dot product with the unit query over their norm),
        not by dot product, so that a row's length never crowds out the true nearest; a row
        whose length float32 cannot rank safely (_RANKED_NORMS) is always rescored."""
        qu = unit_query(q)
        length = len(self._vectors)
        full = stop_seq - start_seq == length
        if full:
            # Every row (a full ring, the common case): one product over the whole array
            # instead of one per run and their concatenation.
            estimates = _cosine_estimates(self._vectors, self._norms, qu)
        else:  # the runs' estimates, in the order of their entries
            runs = self._runs(start_seq, stop_seq)
            estimates = np.concatenate(
                [_cosine_estimates(self._vectors[a:b], self._norms[a:b], qu) for _, a, b in runs]
            )
        finite = estimates[np.isfinite(estimates)]
        best = float(finite.max()) if len(finite) else -np.inf
        at = np.flatnonzero((estimates >= best - _RESCORE_MARGIN) | np.isinf(estimates))
        if full:  # rows to entries
            at = (at - self._rows_of(start_seq)) % length
        return (start_seq + at).astype(np.int64)

    def _rows_of(self, seqs: Any) -> Any:
        """The rows of the ring that hold the live entries `seqs` (a number, or an array)."""
        return (self._head + (seqs - self._first_seq)) % max(1, len(self._vectors))

    def _runs(self, start_seq: int, stop_seq: int) -> list[tuple[int, int, int]]:
        """[start, stop) as at most two contiguous runs of rows: (first seq, row start, stop)."""
        length = len(self._vectors)
        row = self._rows_of(start_seq)
        count = stop_seq - start_seq
        if row + count <= length:
            return [(start_seq, row, row + count)]
        first = length - row
        return [(start_seq, row, length), (start_seq + first, 0, count - first)]

    def _best(self, q: Vector, seqs: npt.NDArray[np.int64]) -> Nearest:
        """The exact (float64) best of the given entries; ties go to the newest."""
        if len(seqs) > 1:
            seqs = np.unique(seqs)  # sorted: the newest last
        slots = self._rows_of(seqs)
        q64 = q.astype(np.float64)
        q_norm = norm64(q)
        # Row by row in the same summation order as exact_cosine, whatever the row count.
        dots = (self._vectors[slots].astype(np.float64) * q64).sum(axis=1)
        denominators = self._norms[slots] * q_norm
        cosines = np.divide(dots, denominators, out=np.zeros_like(dots), where=denominators != 0)
        # The newest of the maximal ones: the last index of the maximum.
        at = len(cosines) - 1 - int(np.argmax(cosines[::-1]))
        slot = int(slots[at])
        # The reference starts its running maximum at -1.
        return Nearest(
            max(-1.0, float(cosines[at])), str(self._trace_ids[slot]), float(self._added_at[slot])
        )

    def _arrays(self) -> tuple[npt.NDArray[Any], ...]:
        return self._vectors, self._norms, self._added_at, self._trace_ids

    def _grow(self, to: int | None = None) -> None:
        new_len = min(self.capacity, max(64, 2 * len(self._vectors))) if to is None else to
        order = self._rows_of(np.arange(self._first_seq, self._first_seq + self._size))
        grown = []
        for old in self._arrays():  # the live rows first, oldest first
            new = np.empty((new_len, *old.shape[1:]), dtype=old.dtype)
            new[: self._size] = old[order]
            grown.append(new)
        self._vectors, self._norms, self._added_at, self._trace_ids = grown
        self._head = 0
        self._prefaulted = self._size

    def _drop_expired(self) -> None:
        if self.ttl_ms is None or self._size == 0:
            return
        cutoff = self.now_ms() - self.ttl_ms
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


#: Rows whose norm is in this range are ranked by their float32 product with the unit query
#: (neither it nor its terms overflow or lose precision to underflow); the others (never seen
#: from the model or a checked import) are always rescored exactly in float64.
_RANKED_NORMS = (1e-20, 1e20)


def unit_query(q: Vector) -> Vector:
    """`q` at length 1, computed in float64 (a zero query stays zero)."""
    wide = q.astype(np.float64)
    norm = float(np.sqrt((wide * wide).sum()))
    return q if norm == 0 else (wide / norm).astype(np.float32)


def _cosine_estimates(
    rows: npt.NDArray[np.float32], norms: npt.NDArray[np.float64], qu: Vector
) -> npt.NDArray[np.float64]:
    """Each row's float32 cosine with the unit query `qu` (0 for a zero row; +inf, always a
    candidate, for a row outside _RANKED_NORMS)."""
    scores = (rows @ qu).astype(np.float64)
    estimates = np.divide(scores, norms, out=np.zeros_like(scores), where=norms != 0)
    odd = (norms != 0) & ((norms < _RANKED_NORMS[0]) | (norms > _RANKED_NORMS[1]))
    if odd.any():
        estimates[odd] = np.inf
    return estimates


def exact_cosine(a: Vector, b: Vector) -> float:
    """The cosine of two vectors in float64, as the cache rescores (0 for a zero vector)."""
    denominator = norm64(b) * norm64(a)
    dot = float((b.astype(np.float64) * a.astype(np.float64)).sum())
    return 0.0 if denominator == 0 else max(-1.0, dot / denominator)


def _row_norms(rows: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    """Each row's norm as norm64 computes it, a block at a time (no float64 copy of all)."""
    out = np.empty(len(rows), dtype=np.float64)
    # Blocks that stay in the CPU's cache (the same sums: each row's is its own).
    for start in range(0, len(rows), _NORM_BLOCK):
        wide = rows[start : start + _NORM_BLOCK].astype(np.float64)
        np.multiply(wide, wide, out=wide)
        out[start : start + _NORM_BLOCK] = np.sqrt(wide.sum(axis=1))
    return out


_NORM_BLOCK = 256


def norm64(v: Vector) -> float:
    wide = v.astype(np.float64)
    return float(np.sqrt((wide * wide).sum()))
