"""The approximate index of a large novelty memory (docs/operating/large-memory.md).

A faiss HNSW graph over 8-bit scalar-quantised codes (`IndexHNSWSQ`, inner product on unit
vectors). It only proposes candidates: the cache rescores them exactly from its own float32
rows, so an answer is always a true cosine with a stored vector.

A graph covers one contiguous run of the cache's sequence numbers, in order: its internal id
`i` is the entry `first_id + i`, so restricting a search to the live entries is an id range.
faiss's HNSW may not be searched while it is added to, so the cache adds to a graph only when
no search can run on it (a graph being built is private; a serving graph is extended under
the cache's lock). Graphs are never pruned: evicted entries are filtered out by the id range
until the whole graph is replaced by one built on the live entries (no tombstones that leak).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

#: The callback writer's chunk: large enough that its Python calls cost nothing.
_WRITE_CHUNK = 1 << 20


def _faiss() -> Any:
    """faiss, imported on first use: its import is about 30 ms of every start otherwise, and
    only a memory past the threshold needs it. Any: faiss's bundled type hints lack most of
    its HNSW API (SearchParametersHNSW, the graph's arrays) and mistype IndexHNSWSQ's
    arguments."""
    import faiss

    return faiss


def one_core_for_this_thread() -> None:
    """faiss's OpenMP work started from the calling thread runs on one core."""
    _faiss().omp_set_num_threads(1)


@dataclass(frozen=True, slots=True)
class IndexParams:
    """m: graph neighbours per node; ef_construction / ef_search: the candidate lists of an
    insert / a query; candidates: how many a query proposes for exact rescoring; ef_search_far:
    the candidate list of a second search, for a query whose best rescored cosine after the
    first is below far_below (0: no second search)."""

    m: int = 64
    ef_construction: int = 80
    ef_search: int = 128
    candidates: int = 16
    ef_search_far: int = 1024
    far_below: float = 0.75


# Chosen by sweeps on real MiniLM vectors (bench.memory's 100k and 1M and its 500 edited and
# 500 fresh paragraphs; AMD EPYC, one core, host shared; docs/decisions/approximate-index.md). M=32
# left a few stored paragraphs nearly unreachable; M=64 with efConstruction 80 finds every
# near-duplicate at efSearch 128. SQ8 codes find the same maxima as float32 ones, faster, in a
# quarter of the bytes. The maxima it misses at a million (4% of all queries, nearly all
# fresh) were never among the efSearch-long list, so rescoring more candidates finds none of
# them; a wider list does, at a cost linear in its length. Only queries far from everything
# (best cosine found < 0.75: no near-duplicate; a missed one is found at about 0.6) pay for it:
# a second search at efSearch 1024 took all-query recall at a million from 0.958 to 0.998 and
# the worst difference from 0.218 to 0.007, while near-duplicates stop after the first.
DEFAULT_PARAMS = IndexParams()


class AnnIndex:
    """One HNSW graph over unit vectors numbered first_id, first_id + 1, ... Not thread-safe:
    the cache serialises every use of a graph that can be searched."""

    def __init__(self, dimensions: int, first_id: int, params: IndexParams = DEFAULT_PARAMS):
        self.dimensions = dimensions
        self.first_id = first_id
        self.params = params
        faiss = _faiss()
        self._index: Any = faiss.IndexHNSWSQ(
            dimensions, faiss.ScalarQuantizer.QT_8bit, params.m, faiss.METRIC_INNER_PRODUCT
        )
        self._index.hnsw.efConstruction = params.ef_construction

    def train(self, sample: npt.NDArray[np.float32]) -> None:
        """The codes' per-dimension ranges, from a sample of the vectors."""
        self._index.train(np.ascontiguousarray(sample, dtype=np.float32))

    @property
    def count(self) -> int:
        return int(self._index.ntotal)

    @property
    def stop_id(self) -> int:
        """The id after the last one in the graph."""
        return self.first_id + self.count

    def add(self, unit_vectors: npt.NDArray[np.float32]) -> None:
        """Appends the next entries, ids stop_id, stop_id + 1, ..."""
        self._index.add(np.ascontiguousarray(unit_vectors, dtype=np.float32))

    def search(
        self, unit_query: npt.NDArray[np.float32], min_id: int, ef_search: int | None = None
    ) -> npt.NDArray[np.int64]:
        """Ids (>= min_id) of the entries the graph finds closest; fewer when it finds fewer.
        ef_search: this search's candidate list, when not params.ef_search."""
        if min_id >= self.stop_id:
            return np.empty(0, dtype=np.int64)
        params = _faiss().SearchParametersHNSW()
        params.efSearch = self.params.ef_search if ef_search is None else ef_search
        if min_id > self.first_id:
            selector = _faiss().IDSelectorRange(min_id - self.first_id, self.count)
            params.sel = selector
        _, ids = self._index.search(
            unit_query.reshape(1, -1), self.params.candidates, params=params
        )
        found: npt.NDArray[np.int64] = ids[0][ids[0] >= 0] + self.first_id
        return found

    def to_bytes(self) -> bytearray:
        """The graph and its codes in faiss's own format (snapshots, a shared memory's
        published graph). Only while no one adds to it: a private graph, or the serving one
        from the thread that alone adds to it (searches only read it).

        Written through faiss's callback writer into one growing buffer: faiss's
        serialize_index holds the whole graph in a C++ vector and then a numpy copy (and
        bytes() a third), about 1.8 GB more than the result at a million entries, where this
        peaks at the result's 0.9 GB (docs/decisions/index-graph-adopted.md)."""
        out = bytearray()

        def write(chunk: bytes) -> int:
            out.extend(chunk)
            return len(chunk)

        faiss = _faiss()
        faiss.write_index(self._index, faiss.PyCallbackIOWriter(write, _WRITE_CHUNK))
        return out

    @classmethod
    def from_bytes(
        cls,
        data: bytes | bytearray,
        dimensions: int,
        first_id: int,
        params: IndexParams = DEFAULT_PARAMS,
    ) -> AnnIndex:
        """A graph saved by to_bytes, numbered from first_id. ValueError when the bytes are not
        an HNSW-SQ8 inner-product graph of `dimensions` built with params' m and
        ef_construction (a graph built otherwise would answer with another recall)."""
        faiss = _faiss()
        try:
            index = faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"not a faiss index: {exc}") from None
        # deserialize_index already returns the concrete class (and owns it: a downcast
        # wrapper would not, and the index would be freed under it).
        if not isinstance(index, faiss.IndexHNSWSQ):
            raise ValueError(f"a {type(index).__name__}, not an IndexHNSWSQ")
        storage = faiss.downcast_index(index.storage)
        built_with = (
            index.d,
            index.metric_type,
            storage.sq.qtype if isinstance(storage, faiss.IndexScalarQuantizer) else None,
            index.hnsw.nb_neighbors(1),
            index.hnsw.efConstruction,
        )
        wanted = (
            dimensions,
            faiss.METRIC_INNER_PRODUCT,
            faiss.ScalarQuantizer.QT_8bit,
            params.m,
            params.ef_construction,
        )
        if built_with != wanted:
            raise ValueError(
                "built with (dimensions, metric, codes, m, ef_construction) = "
                f"{built_with}, not {wanted}"
            )
        graph = cls.__new__(cls)
        graph.dimensions, graph.first_id, graph.params, graph._index = (
            dimensions,
            first_id,
            params,
            index,
        )
        return graph

    def stored_vector(self, seq: int) -> npt.NDArray[np.float32]:
        """The (decoded, approximate) unit vector the graph holds for entry `seq`."""
        out: npt.NDArray[np.float32] = self._index.reconstruct(seq - self.first_id)
        return out

    @property
    def memory_bytes(self) -> int:
        # Codes, then the graph: neighbour lists (int32), levels (int32) and offsets (uint64).
        hnsw = self._index.hnsw
        return int(
            self.count * _faiss().downcast_index(self._index.storage).code_size
            + 4 * hnsw.neighbors.size()
            + 4 * hnsw.levels.size()
            + 8 * hnsw.offsets.size()
        )
