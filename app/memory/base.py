"""The novelty memory's interface: what the evaluator and the /cache routes may ask of it (the
implementations: app/memory/__init__.py). This module imports none of them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt
from pydantic import TypeAdapter

from app.core import namespaces
from app.core.errors import ServiceError
from app.core.health import Health
from app.core.states import BackendKind
from app.memory.ring import CacheEntries, CacheStats

Vector = npt.NDArray[np.float32]
#: How max_cosine was found: "exact" (every entry compared: the true maximum) or "index"
#: (an approximate index, Redis's HNSW: a true cosine with the entry it names).
SearchMethod = Literal["exact", "index"]
#: The namespace of a request that names none (docs/api.md, namespaces).
DEFAULT_NAMESPACE = "default"
#: How long a compare's receipt is kept: the day an idempotency record is replayed for.
RECEIPT_TTL_MS = 24 * 3600 * 1000


class MemoryUnavailableError(ServiceError):
    """The memory cannot be read or changed now (shared mode: Redis unreachable or refusing);
    nothing was added. A scoring request degrades (novelty not measured); an operator's request
    is refused with 503."""

    def __init__(self, message: str) -> None:
        super().__init__(503, "cache_unavailable", message, retry_after=1)


class NamespaceLimitError(ServiceError):
    """A new namespace would pass KP_MAX_NAMESPACES; nothing was added. Not transient (no
    Retry-After): it holds until a namespace is cleared or expires."""

    def __init__(self, message: str) -> None:
        super().__init__(409, "namespace_limit", message, loc=namespaces.LOC)


@dataclass(frozen=True, slots=True)
class NearestTrace:
    """The stored trace with the largest cosine (ties: the newest), and how long ago it was
    stored, as of this trace's turn."""

    trace_id: str
    cosine: float
    age_ms: float


@dataclass(frozen=True, slots=True)
class Comparison:
    """One trace against its namespace's memory as it stood just before that trace's turn."""

    max_cosine: float | None  # None: the memory was empty
    size: int  # vectors compared against
    nearest: NearestTrace | None = None
    search: SearchMethod = "exact"
    search_bound: float | None = None  # "index": how far below the exact maximum it may be
    #: The trace is in the memory now (committed: it survives a crash as the docs say). False
    #: for a dry run, and when it could not be stored (`not_stored`, e.g. a full disk).
    stored: bool = False
    not_stored: str | None = None  # why a trace asked to be added was not


#: Comparisons as a receipt keeps them (JSON).
RECEIPT = TypeAdapter(list[Comparison])


@dataclass(frozen=True, slots=True)
class BackendInfo:
    """Where the memory is, for operators (/cache, /readyz, the log)."""

    kind: BackendKind
    shared: bool
    location: str | None  # the Redis URL without its password, or the database's path
    prefix: str | None
    available: bool
    reason: str | None  # why it is unavailable
    outages_total: int


@dataclass(frozen=True, slots=True)
class MemoryFaults:
    """What the memory cannot do now, part by part, for the metrics (the shared memory's;
    the in-process database reports its own: app/memory/sqlite.py, StorageStatus)."""

    #: Namespaces refused now, each for its own reason (an index missing and made again, or
    #: another's): the others answer as usual.
    namespaces_unavailable: int = 0
    #: Indexes this process made again after they went (FT.DROPINDEX), since start.
    index_rebuilds_total: int = 0
    #: Redis's maxmemory-policy may evict the memory's keys: traces are not stored.
    eviction_unsafe: bool = False
    #: Traces answered as not stored because of it, since start.
    not_stored_total: int = 0


class NoveltyMemory(Protocol):
    """The vectors novelty is measured against (docs/scoring.md): one memory per namespace,
    each with its capacity, TTL and one order for every request."""

    @property
    def backend(self) -> BackendInfo: ...

    @property
    def size(self) -> int:
        """Vectors held in every namespace as last seen, without I/O (readiness, metrics)."""

    dimensions: int

    @property
    def evictions_total(self) -> int: ...

    @property
    def faults(self) -> MemoryFaults: ...

    def health(self) -> Health: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def compare(
        self,
        namespace: str,
        vectors: Sequence[Vector],
        trace_ids: Sequence[str],
        *,
        add: bool,
        receipt: str | None = None,
    ) -> list[Comparison]:
        """Each vector in order against the namespace's memory; with `add`, each is added after
        its comparison and the later ones see it, and no other request's vector comes between
        them. Without `add` nothing is kept (later vectors of the call still see earlier ones).
        `receipt` (with `add`): a request's key (its Idempotency-Key's); the comparisons are
        kept under it, committed with the adds, for RECEIPT_TTL_MS, and a later call with it
        gets them again and adds nothing (a retry whose first answer was lost in a crash).
        MemoryUnavailableError when the memory cannot be reached (nothing was added);
        NamespaceLimitError when `add` would create a namespace past the limit."""

    async def namespaces(self) -> list[str]:
        """The namespaces that hold at least one entry, sorted."""

    async def stats(self, namespace: str) -> CacheStats: ...

    async def clear(self, namespace: str) -> int:
        """Empty the namespace's memory (for every replica); how many vectors were dropped."""

    def export_chunks(self, namespace: str) -> AsyncIterator[CacheEntries]:
        """Every entry of the namespace, oldest first, a chunk at a time."""

    async def import_entries(self, namespace: str, entries: CacheEntries) -> tuple[int, int]:
        """Appends `entries` in order as the namespace's newest (capacity and TTL apply);
        returns (added, skipped as expired). MemoryUnavailableError when it cannot be reached;
        NamespaceLimitError as in compare."""
