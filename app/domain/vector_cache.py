"""The process-wide vector cache that novelty is measured against (SPEC section 6).

A ring buffer of float32 rows: adding never moves data, eviction is oldest first, and the scan
is one matrix-vector product. Cosines are then recomputed in float64 for the few rows that can
be the maximum, so the result equals the reference's double-precision loop, not just nearly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Vector = npt.NDArray[np.float32]

# float32 dot products of unit vectors are within ~1e-6 of the exact value; every row this close
# to the float32 maximum is rescored exactly.
_RESCORE_MARGIN = 1e-4


def wall_clock_ms() -> float:
    return time.time() * 1000.0


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
    """The cached vectors oldest first, with the wall-clock time (ms) each was added."""

    vectors: npt.NDArray[np.float32]
    added_at_ms: npt.NDArray[np.float64]


class VectorCache:
    """Bounded, thread-safe store of unit vectors with exact maximum-cosine search."""

    def __init__(
        self,
        capacity: int = 1000,
        dimensions: int = 384,
        ttl_ms: float | None = None,
        clock_ms: Callable[[], float] = wall_clock_ms,
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
        self._clock_ms = clock_ms
        self._lock = threading.RLock()
        # Rows are allocated as the cache grows, so a large capacity costs nothing up front.
        self._vectors = np.empty((0, dimensions), dtype=np.float32)
        self._norms = np.empty(0, dtype=np.float64)
        self._added_at = np.empty(0, dtype=np.float64)
        self._head = 0  # index of the oldest entry
        self._size = 0
        self.adds_total = 0
        self.evictions_total = 0
        self.clears_total = 0

    # ── queries ─────────────────────────────────────────────────────────────

    @property
    def size(self) -> int:
        with self._lock:
            self._drop_expired()
            return self._size

    def max_cosine_similarity(self, query: npt.ArrayLike) -> float:
        """The largest cosine between `query` and a cached vector; 0.0 when the cache is empty."""
        q = self._as_vector(query)
        with self._lock:
            self._drop_expired()
            if self._size == 0:
                return 0.0
            segments = self._segments()
            partial = [self._vectors[start:stop] @ q for start, stop in segments]
            best = max(float(p.max()) for p in partial)
            candidates = np.concatenate(
                [
                    start + np.flatnonzero(p >= best - _RESCORE_MARGIN)
                    for (start, _), p in zip(segments, partial, strict=True)
                ]
            )
            return self._exact_max_cosine(q, candidates)

    def stats(self) -> CacheStats:
        with self._lock:
            self._drop_expired()
            now = self._clock_ms()
            times = self._live_times()
            return CacheStats(
                size=self._size,
                capacity=self.capacity,
                dimensions=self.dimensions,
                ttl_ms=self.ttl_ms,
                memory_bytes=int(self._vectors.nbytes + self._norms.nbytes + self._added_at.nbytes),
                oldest_age_ms=float(now - times[0]) if self._size else None,
                newest_age_ms=float(now - times[-1]) if self._size else None,
                adds_total=self.adds_total,
                evictions_total=self.evictions_total,
            )

    def entries(self) -> CacheEntries:
        """A copy of the live entries, oldest first (for snapshots)."""
        with self._lock:
            self._drop_expired()
            order = self._ordered_indices()
            return CacheEntries(self._vectors[order].copy(), self._added_at[order].copy())

    # ── updates ─────────────────────────────────────────────────────────────

    def add(self, vector: npt.ArrayLike, added_at_ms: float | None = None) -> None:
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
                self.evictions_total += 1
            elif self._size == len(self._vectors):
                self._grow()
            slot = (self._head + self._size) % len(self._vectors)
            self._vectors[slot] = v
            self._norms[slot] = np.sqrt(np.dot(v.astype(np.float64), v.astype(np.float64)))
            self._added_at[slot] = now
            self._size += 1
            self.adds_total += 1

    def copy(self) -> VectorCache:
        """An independent cache with the same entries, settings and clock."""
        with self._lock:
            other = VectorCache(self.capacity, self.dimensions, self.ttl_ms, self._clock_ms)
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
        if added_at.shape != (len(vectors),) or not np.isfinite(vectors).all():
            raise ValueError("entries are inconsistent or not finite")
        vectors, added_at = (
            vectors[-self.capacity :],
            np.maximum.accumulate(added_at[-self.capacity :]),
        )
        with self._lock:
            self._vectors = vectors.copy()
            wide = self._vectors.astype(np.float64)
            self._norms = np.sqrt((wide * wide).sum(axis=1))
            self._added_at = added_at.copy()
            self._head = 0
            self._size = len(vectors)

    def clear(self) -> int:
        """Empty the cache; returns how many vectors were dropped."""
        with self._lock:
            dropped = self._size
            self._head = 0
            self._size = 0
            self.clears_total += 1
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

    def _exact_max_cosine(self, q: Vector, rows: npt.NDArray[np.intp]) -> float:
        q64 = q.astype(np.float64)
        q_norm = float(np.sqrt(np.dot(q64, q64)))
        dots = self._vectors[rows].astype(np.float64) @ q64
        denominators = self._norms[rows] * q_norm
        with np.errstate(divide="ignore", invalid="ignore"):
            cosines = np.where(denominators == 0, 0.0, dots / denominators)
        # The reference starts its running maximum at -1.
        return max(-1.0, float(cosines.max()))

    def _grow(self) -> None:
        new_len = min(self.capacity, max(64, 2 * len(self._vectors)))
        order = self._ordered_indices()
        vectors = np.empty((new_len, self.dimensions), dtype=np.float32)
        norms = np.empty(new_len, dtype=np.float64)
        added = np.empty(new_len, dtype=np.float64)
        vectors[: self._size] = self._vectors[order]
        norms[: self._size] = self._norms[order]
        added[: self._size] = self._added_at[order]
        self._vectors, self._norms, self._added_at = vectors, norms, added
        self._head = 0

    def _tail_index(self) -> int:
        return (self._head + self._size - 1) % len(self._vectors)

    def _ordered_indices(self) -> npt.NDArray[np.intp]:
        return (self._head + np.arange(self._size)) % max(1, len(self._vectors))

    def _segments(self) -> list[tuple[int, int]]:
        """The live rows as at most two contiguous slices of the ring, oldest first."""
        end = self._head + self._size
        if end <= len(self._vectors):
            return [(self._head, end)]
        return [(self._head, len(self._vectors)), (0, end - len(self._vectors))]

    def _live_times(self) -> npt.NDArray[np.float64]:
        return self._added_at[self._ordered_indices()]

    def _drop_expired(self) -> None:
        if self.ttl_ms is None or self._size == 0:
            return
        cutoff = self._clock_ms() - self.ttl_ms
        if self._added_at[self._head] > cutoff:
            return
        # The reference keeps entries with addedAt > cutoff; times are ordered, so the expired
        # ones are a prefix.
        expired = int(np.searchsorted(self._live_times(), cutoff, side="right"))
        if expired:
            self._head = (self._head + expired) % len(self._vectors)
            self._size -= expired
