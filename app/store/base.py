"""The novelty memory's interface: what the evaluator and the /cache routes may ask of it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from app.core.health import Health
from app.core.states import BackendKind
from app.domain.vector_cache import CacheEntries, CacheStats, SearchMethod
from app.store.indexed_memory import IndexedCache, IndexStatus

Vector = npt.NDArray[np.float32]


class MemoryUnavailableError(Exception):
    """The memory cannot be read or changed now (shared mode: Redis unreachable or refusing);
    nothing was added."""


@dataclass(frozen=True, slots=True)
class NearestTrace:
    """The stored trace with the largest cosine (ties: the newest), and how long ago it was
    stored, as of this trace's turn."""

    trace_id: str
    cosine: float
    age_ms: float


@dataclass(frozen=True, slots=True)
class Comparison:
    """One trace against the memory as it stood just before that trace's turn."""

    max_cosine: float | None  # None: the memory was empty
    size: int  # vectors compared against
    nearest: NearestTrace | None = None
    search: SearchMethod = "exact"  # how max_cosine was found
    search_bound: float | None = None  # "index": how far below the exact maximum it may be


@dataclass(frozen=True, slots=True)
class BackendInfo:
    """Where the memory is, for operators (/cache, /readyz, the log)."""

    kind: BackendKind
    shared: bool
    location: str | None  # the Redis URL without its password
    prefix: str | None
    available: bool
    reason: str | None  # why it is unavailable
    outages_total: int


class NoveltyMemory(Protocol):
    """The vectors novelty is measured against (docs/scoring.md), one order for every
    request."""

    @property
    def backend(self) -> BackendInfo: ...

    @property
    def size(self) -> int:
        """Vectors held as last seen, without I/O (readiness, metrics)."""
        ...

    @property
    def dimensions(self) -> int: ...

    @property
    def evictions_total(self) -> int: ...

    def index_status(self) -> IndexStatus:
        """The approximate index of this process's copy of the memory."""
        ...

    def run_audit(self, limit: int) -> int:
        """Reruns sampled index answers exactly (blocking: call from a worker thread)."""
        ...

    @property
    def local_cache(self) -> IndexedCache:
        """The vectors this process holds (the memory itself, or its mirror of the shared
        one): what cache snapshots save and restore."""
        ...

    def health(self) -> Health: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def compare(
        self, vectors: Sequence[Vector], trace_ids: Sequence[str], *, add: bool
    ) -> list[Comparison]:
        """Each vector in order against the memory; with `add`, each is added after its
        comparison and the later ones see it, and no other request's vector comes between
        them. Without `add` nothing is kept (later vectors of the call still see earlier ones).
        MemoryUnavailableError when the memory cannot be reached; then nothing was added."""
        ...

    async def stats(self) -> CacheStats: ...

    async def clear(self) -> int:
        """Empty the memory (for every replica); how many vectors were dropped."""
        ...

    def export_chunks(self) -> AsyncIterator[CacheEntries]:
        """Every entry, oldest first, a chunk at a time."""
        ...

    async def import_entries(self, entries: CacheEntries) -> tuple[int, int]:
        """Appends `entries` in order as the newest (capacity and TTL apply); returns
        (added, skipped as expired). MemoryUnavailableError when it cannot be reached."""
        ...
