"""Upper bounds of every stored entry's cosine with a query, for an exact scan that reads a
fraction of the memory (docs/operating/large-memory.md, docs/decisions/pruned-exact-scan.md).

Each entry's unit vector x is split along an orthonormal basis W (the leading principal
directions of a sample of the memory, 64 of them by default) into its coordinates p = W x and
the rest, whose length r = |x - Wᵀp| is kept. For a unit query q with coordinates w = W q and
rest length s, Cauchy-Schwarz on the rest gives

    cos(q, x) = w·p + (q - Wᵀw)·(x - Wᵀp) <= w·p + s r,

a bound computed from 64 numbers instead of 384. It is applied in two tiers: the first 20
coordinates of every entry (one product over a contiguous array), then all 64 for the few that
pass; only the entries whose bound can reach a known cosine (the best an index found) are
rescored exactly. The coordinates are computed in float64 and stored in float32, and every
bound is lowered by MARGIN before it is compared: rounding moves a bound by about 1e-6, so the
entries skipped are provably below the known cosine and the answer equals the full scan's.

Entries are held by sequence number in segments of SEGMENT; a segment is dropped whole once
every entry in it has left the memory. Pure: no threads, no I/O; the cache serialises use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]

#: Coordinates per tier: the first tier's over every entry, the second's over those it passes
#: (docs/decisions/pruned-exact-scan.md: 20 reads less than 32 at a million entries and
#: leaves about as few to rescore at a hundred thousand).
DEFAULT_TIERS = (20, 64)
#: Entries a basis is fitted on (evenly spread over the memory): the directions are stable
#: well before this many.
FIT_SAMPLE = 20_000
#: A bound is lowered by this much before it is compared: the rounding of float32 coordinates
#: and their products moves it by about 1e-6 (at most about 2e-5 in the worst case).
MARGIN = 1e-4
SEGMENT = 65_536
#: Added to a rest length's square (computed as 1 less the coordinates' squares, off by about
#: 1e-14 in float64) so that it is never below the true one; it loosens a bound by at most
#: 1e-6 times the query's rest length.
ROUNDING = 1e-12


def fit_basis(units: F64, dimensions: int) -> F64:
    """The `dimensions` leading principal directions (uncentred) of the unit rows `units`,
    orthonormal rows of a (dimensions x d) float64 array."""
    wide = np.asarray(units, dtype=np.float64)
    _, vectors = np.linalg.eigh(wide.T @ wide)  # ascending eigenvalues
    return np.ascontiguousarray(vectors[:, ::-1][:, :dimensions].T)


@dataclass(frozen=True, slots=True)
class Projected:
    """Entries' coordinates and rest lengths (CosineBounds.project)."""

    coords: F32
    lead_left: F32
    rest_left: F32


@dataclass(slots=True)
class _Segment:
    first: int  # the sequence number of row 0
    lead: F32  # (SEGMENT, tiers[0]) coordinates
    rest: F32  # (SEGMENT, tiers[1] - tiers[0]) coordinates
    lead_left: F32  # the rest's length after the first tier
    rest_left: F32  # ... after both
    filled: int = 0


@dataclass(slots=True)
class CosineBounds:
    """The bounds of the entries start <= seq < stop (module docstring)."""

    basis: F64
    start: int
    tiers: tuple[int, int] = DEFAULT_TIERS
    #: The entries the basis was fitted on: those before fitted_stop, fitted_on of them.
    fitted_stop: int = 0
    fitted_on: int = 0
    _segments: list[_Segment] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0 < self.tiers[0] <= self.tiers[1] <= len(self.basis):
            raise ValueError(f"tiers {self.tiers} do not fit a basis of {len(self.basis)}")

    @property
    def stop(self) -> int:
        if not self._segments:
            return self.start
        last = self._segments[-1]
        return last.first + last.filled

    @property
    def memory_bytes(self) -> int:
        per_row = 4 * (self.tiers[1] + 2)
        return len(self._segments) * SEGMENT * per_row + self.basis.nbytes

    def extend(self, rows: F32, norms: F64) -> None:
        """Adds the entries stop, stop + 1, ...: their rows as stored and their float64
        norms (a zero row's cosine is 0: its bound is 0)."""
        self.append(self.project(rows, norms))

    def project(self, rows: F32, norms: F64) -> Projected:
        """The bounds' numbers for `rows` (no change: may run outside the cache's lock)."""
        k1, k2 = self.tiers
        coords = np.asarray(rows, dtype=np.float64) @ self.basis[:k2].T
        coords /= np.where(norms == 0, 1.0, norms)[:, None]
        # A unit row's squared length is 1 (a zero row's 0): its rest's is what its
        # coordinates leave of it (Pythagoras, W orthonormal).
        length = (norms > 0).astype(np.float64)
        squares = coords * coords
        lead_left = length - squares[:, :k1].sum(axis=1)
        rest_left = lead_left - squares[:, k1:].sum(axis=1)
        return Projected(coords.astype(np.float32), _root_up(lead_left), _root_up(rest_left))

    def append(self, projected: Projected) -> None:
        """Adds the entries stop, stop + 1, ... from their `project`ed numbers."""
        k1 = self.tiers[0]
        count = len(projected.coords)
        done = 0
        while done < count:
            if not self._segments or self._segments[-1].filled == SEGMENT:
                self._segments.append(self._new_segment(self.stop))
            segment = self._segments[-1]
            n = min(SEGMENT - segment.filled, count - done)
            at = slice(segment.filled, segment.filled + n)
            part = slice(done, done + n)
            segment.lead[at] = projected.coords[part, :k1]
            segment.rest[at] = projected.coords[part, k1:]
            segment.lead_left[at] = projected.lead_left[part]
            segment.rest_left[at] = projected.rest_left[part]
            segment.filled += n
            done += n

    def drop_before(self, seq: int) -> None:
        """Forgets the segments whose entries are all older than `seq` (evicted, expired);
        when every entry held is older, the next one appended is `seq`."""
        if self.stop <= seq:
            self._segments.clear()
            self.start = max(self.start, seq)
            return
        while self._segments[0].first + self._segments[0].filled <= seq:
            self._segments.pop(0)
        self.start = max(self.start, self._segments[0].first)

    def candidates(self, query: F64, first: int, stop: int, lower: float) -> npt.NDArray[np.int64]:
        """The entries first <= seq < stop (within start..stop) whose cosine with the unit
        float64 `query` can be `lower` or more."""
        k1, k2 = self.tiers
        coords = self.basis[:k2] @ query
        w1, w2 = coords[:k1].astype(np.float32), coords[k1:].astype(np.float32)
        s1 = float(np.linalg.norm(query - self.basis[:k1].T @ coords[:k1]))
        s2 = float(np.linalg.norm(query - self.basis[:k2].T @ coords))
        floor = lower - MARGIN
        found = []
        for segment in self._segments:
            lo = max(first, segment.first) - segment.first
            hi = min(stop, segment.first + segment.filled) - segment.first
            if lo >= hi:
                continue
            # float32 sums of terms below 1 in size: off by about 1e-7, far inside MARGIN.
            partial = segment.lead[lo:hi] @ w1
            bound = segment.lead_left[lo:hi] * np.float32(s1)
            bound += partial
            rows = np.flatnonzero(bound >= floor)
            if len(rows) == 0:
                continue
            full = partial[rows].astype(np.float64)
            full += segment.rest[lo + rows] @ w2
            full += s2 * segment.rest_left[lo + rows]
            found.append(segment.first + lo + rows[full >= floor])
        if not found:
            return np.empty(0, dtype=np.int64)
        return np.concatenate(found).astype(np.int64)

    def _new_segment(self, first: int) -> _Segment:
        k1, k2 = self.tiers
        return _Segment(
            first,
            np.empty((SEGMENT, k1), dtype=np.float32),
            np.empty((SEGMENT, k2 - k1), dtype=np.float32),
            np.empty(SEGMENT, dtype=np.float32),
            np.empty(SEGMENT, dtype=np.float32),
        )


def _root_up(squares: F64) -> F32:
    """The square roots of rest lengths' squares, made never smaller than the true ones:
    their float64 rounding (about 1e-14, from 1 less a sum near 1) is covered by ROUNDING
    before the root, and the root is rounded up to float32 (a bound must not shrink)."""
    rest = np.sqrt(np.maximum(squares, 0.0) + ROUNDING)
    out: F32 = rest.astype(np.float32)
    up = out < rest
    out[up] = np.nextafter(out[up], np.float32(np.inf))
    return out
