"""Cache persistence: a snapshot file that survives restarts (KP_CACHE_SNAPSHOT_PATH).

The file is written whole to a temporary name, fsynced, then renamed over the old one, so a
crash at any moment leaves either the previous snapshot or the new one, never half of one. A
checksum over the payload catches damage; a snapshot made by another model (or dimension) is
set aside rather than loaded, since its vectors would not be comparable.

Layout: 8-byte magic, 4-byte little-endian header length, JSON header, then the payload:
`count x dimensions` float32 vectors, `count` float64 insertion times (ms), then (format 2)
the trace ids as one JSON array of strings (`trace_ids_bytes` long). Format 1 files, without
trace ids, still load (their entries name no trace).

A large cache is copied a chunk at a time (queries go on between chunks), hashed and written
from those copies in a worker thread, without joining them into one more buffer. When the copy
is one unbroken run of the cache's entries, the header also says where it stands (`lineage`,
`first_seq`: optional keys, so format 2 readers still load it).

The graph of a large memory (docs/operating/large-memory.md) is kept beside the snapshot, in
`<path>.graph` (faiss's serialized index) and `<path>.graph.json` (what it covers: the lineage
and sequence number of its first entry, its count, dimensions, m, efConstruction, model, size
and SHA-256; after a restore, also the numbering the snapshot file still uses: Numbering). It
is written when a build swaps a new graph in, from that graph while it is still private, and
when the feeder has grown the serving graph by a tenth (from the feeder's thread, the graph's
only writer), so it is not rewritten with every periodic snapshot, and never copied under the
cache's lock. A restore adopts it when it covers the snapshot's oldest entries and matches the
cache (anything else: a log line, and the graph is built as without it).

The journal (app/store/journal.py, `<path>.journal.<generation>`) holds every change since the
snapshot: a restore replays it after the snapshot, and a save starts its next generation where
the snapshot's copy is fixed, then deletes the generations the new snapshot holds.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from app.core.health import Health
from app.core.states import SnapshotState
from app.domain.vector_cache import CHUNK, CacheEntries, VectorCache
from app.store.ann_index import DEFAULT_PARAMS, AnnIndex
from app.store.indexed_memory import BuiltGraph, IndexedCache
from app.store.journal import Journal, fsync_directory

log = logging.getLogger(__name__)

MAGIC = b"KPCACHE1"
FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)
_HEADER_LEN = struct.Struct("<I")
_MAX_HEADER = 64 * 1024


class SnapshotError(Exception):
    """The snapshot cannot be used; `kind` says why (corrupt, other_model)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


@dataclass
class SnapshotStatus:
    path: Path | None
    state: SnapshotState
    detail: str | None = None
    loaded_vectors: int = 0
    last_saved_at_ms: float | None = None
    last_save_error: str | None = None
    saves_total: int = 0
    save_errors_total: int = 0


def write_snapshot(
    path: Path,
    entries: CacheEntries | Sequence[CacheEntries],
    model_id: str,
    journal_generation: int | None = None,
) -> None:
    """Atomically replace `path` with a snapshot of `entries` (one copy, or the chunks of
    one, oldest first: written one after the other, never joined). `journal_generation`: the
    first generation of the journal (app/store/journal.py) the snapshot does not hold."""
    chunks = [entries] if isinstance(entries, CacheEntries) else list(entries)
    where = _run_of(chunks)
    vectors = [np.ascontiguousarray(c.vectors, dtype="<f4") for c in chunks]
    times = [np.ascontiguousarray(c.added_at_ms, dtype="<f8") for c in chunks]
    ids = orjson.dumps([trace_id for c in chunks for trace_id in c.ids()])
    parts = [
        *(v.view(np.uint8).reshape(-1).data for v in vectors),
        *(t.view(np.uint8).data for t in times),
        memoryview(ids),
    ]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    dimensions = vectors[0].shape[1] if vectors else 0
    header = json.dumps(
        {
            "version": FORMAT_VERSION,
            "model": model_id,
            "dimensions": int(dimensions),
            "count": sum(len(v) for v in vectors),
            "trace_ids_bytes": len(ids),
            "saved_at_ms": time.time() * 1000.0,
            "payload_sha256": digest.hexdigest(),
            **where,
            **({} if journal_generation is None else {"journal_generation": journal_generation}),
        }
    ).encode()
    _write_atomically(path, [MAGIC + _HEADER_LEN.pack(len(header)) + header, *parts])


def _run_of(chunks: Sequence[CacheEntries]) -> dict[str, object]:
    """{'lineage', 'first_seq'} when the chunks are one unbroken run of one cache's entries
    (a graph can then be mapped onto them), else {}."""
    if not chunks or not chunks[0].lineage:
        return {}
    seq = chunks[0].first_seq
    for chunk in chunks:
        if chunk.first_seq is None or chunk.first_seq != seq or chunk.lineage != chunks[0].lineage:
            return {}
        seq = chunk.first_seq + len(chunk.vectors)
    return {"lineage": chunks[0].lineage, "first_seq": chunks[0].first_seq}


def _write_atomically(path: Path, parts: Sequence[bytes | memoryview]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_directory(path.parent)


def read_snapshot(path: Path, model_id: str, dimensions: int) -> CacheEntries:
    """The entries of a snapshot; SnapshotError when it is damaged or from another model."""
    data = path.read_bytes()
    if len(data) < len(MAGIC) + _HEADER_LEN.size or not data.startswith(MAGIC):
        raise SnapshotError("corrupt", "not a kp-scoring cache snapshot (bad magic)")
    (header_len,) = _HEADER_LEN.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + _HEADER_LEN.size
    if header_len > _MAX_HEADER or start + header_len > len(data):
        raise SnapshotError("corrupt", "truncated snapshot header")
    try:
        header = json.loads(data[start : start + header_len])
        count, dims = int(header["count"]), int(header["dimensions"])
        version, snapshot_model = header["version"], str(header["model"])
        checksum = str(header["payload_sha256"])
        ids_len = int(header.get("trace_ids_bytes", 0))
        lineage, first_seq = str(header.get("lineage", "")), header.get("first_seq")
        first_seq = None if first_seq is None else int(first_seq)
    except (ValueError, KeyError, TypeError) as exc:
        raise SnapshotError("corrupt", f"unreadable snapshot header: {exc}") from None
    if version not in _READABLE_VERSIONS:
        raise SnapshotError("corrupt", f"unknown snapshot format version {version!r}")
    if snapshot_model != model_id or dims != dimensions:
        raise SnapshotError(
            "other_model",
            f"snapshot is from model {snapshot_model} ({dims} dimensions); "
            f"this service runs {model_id} ({dimensions} dimensions)",
        )
    payload = memoryview(data)[start + header_len :]  # views from here on: one copy, in load
    if count < 0 or ids_len < 0 or len(payload) != count * dims * 4 + count * 8 + ids_len:
        raise SnapshotError("corrupt", "snapshot payload is truncated or too long")
    if hashlib.sha256(payload).hexdigest() != checksum:
        raise SnapshotError("corrupt", "snapshot checksum does not match its payload")
    vectors = np.frombuffer(payload, dtype="<f4", count=count * dims).reshape(count, dims)
    times = np.frombuffer(payload, dtype="<f8", offset=count * dims * 4, count=count)
    if not (np.isfinite(vectors).all() and np.isfinite(times).all()):
        raise SnapshotError("corrupt", "snapshot holds non-finite values")
    trace_ids: list[str] = [""] * count
    if ids_len:
        try:
            trace_ids = orjson.loads(payload[count * dims * 4 + count * 8 :])
        except orjson.JSONDecodeError as exc:
            raise SnapshotError("corrupt", f"unreadable trace ids: {exc}") from None
        if not isinstance(trace_ids, list) or len(trace_ids) != count:
            raise SnapshotError("corrupt", "the trace ids do not match the vectors")
    return CacheEntries(
        vectors.astype(np.float32, copy=False),
        times.astype(np.float64, copy=False),
        trace_ids,
        first_seq if lineage else None,
        lineage if first_seq is not None else "",
    )


def journal_generation_of(path: Path) -> int:
    """The first journal generation the snapshot at `path` does not hold (0: it names none,
    so every generation is replayed)."""
    with path.open("rb") as f:
        head = f.read(len(MAGIC) + _HEADER_LEN.size)
        (length,) = _HEADER_LEN.unpack_from(head, len(MAGIC))
        header = json.loads(f.read(min(length, _MAX_HEADER)))
    return int(header.get("journal_generation", 0))


def graph_paths(path: Path) -> tuple[Path, Path]:
    """The graph beside the snapshot at `path`: (its bytes, its description)."""
    return path.with_name(f"{path.name}.graph"), path.with_name(f"{path.name}.graph.json")


def write_graph(
    path: Path,
    built: BuiltGraph,
    model_id: str,
    dimensions: int,
    aliases: Sequence[dict[str, object]] = (),
) -> None:
    """Atomically replaces the graph beside the snapshot at `path`: the bytes first, then the
    description naming their checksum (a crash between leaves a pair that does not match,
    which a restore ignores). `aliases`: other numberings of the same entries (Numbering)."""
    blob, described = graph_paths(path)
    _write_atomically(blob, [memoryview(built.data)])
    _write_graph_description(
        described,
        {
            "model": model_id,
            "dimensions": dimensions,
            "m": DEFAULT_PARAMS.m,
            "ef_construction": DEFAULT_PARAMS.ef_construction,
            "lineage": built.lineage,
            "first_seq": built.first_seq,
            "count": built.count,
            "bytes": len(built.data),
            "sha256": hashlib.sha256(built.data).hexdigest(),
            "aliases": list(aliases),
        },
    )


def _write_graph_description(path: Path, description: dict[str, object]) -> None:
    _write_atomically(path, [json.dumps(description).encode()])


def read_graph(
    path: Path, entries: CacheEntries, model_id: str, dimensions: int
) -> tuple[AnnIndex, int, dict[str, object]]:
    """The graph beside the snapshot at `path` that was built on `entries`' cache, with the
    index in `entries` of its internal id 0 (negative: entries evicted before the snapshot)
    and its description. SnapshotError (kind 'graph') says why it cannot be used."""
    blob, described = graph_paths(path)
    if not entries.lineage or entries.first_seq is None:
        raise SnapshotError("graph", "the snapshot does not say where its entries stand")
    try:
        about = json.loads(described.read_bytes())
        wanted = {
            "model": model_id,
            "dimensions": dimensions,
            "m": DEFAULT_PARAMS.m,
            "ef_construction": DEFAULT_PARAMS.ef_construction,
        }
        differs = {k: about.get(k) for k, v in wanted.items() if about.get(k) != v}
        first_seq = _numberings(about).get(entries.lineage)
        if first_seq is None:
            differs["lineage"] = about.get("lineage")
        if differs or first_seq is None:
            raise SnapshotError("graph", f"it was built for another cache or settings: {differs}")
        data = blob.read_bytes()
        if len(data) != int(about["bytes"]) or hashlib.sha256(data).hexdigest() != about["sha256"]:
            raise SnapshotError("graph", "its bytes do not match their checksum")
        offset = first_seq - entries.first_seq
        index = AnnIndex.from_bytes(data, dimensions, 0)
        if index.count != int(about["count"]):
            raise SnapshotError("graph", "it holds another number of entries than described")
    except OSError as exc:
        raise SnapshotError("graph", f"cannot read it: {exc}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise SnapshotError("graph", f"unreadable: {exc}") from None
    return index, offset, about


def _numberings(about: dict[str, Any]) -> dict[str, int]:
    """{lineage: the sequence number of the graph's first entry} for each numbering of the
    same entries the description names: its own and, after a restore, the snapshot file's."""
    named = [about, *about.get("aliases", ())]
    return {str(n["lineage"]): int(n["first_seq"]) for n in named}


@dataclass(frozen=True, slots=True)
class Numbering:
    """A restore numbers the snapshot's entries anew (the cache's `lineage`), while the file
    on disk keeps its own numbering (`disk_lineage`) until the next save: the same entry is
    `seq` in the cache and `seq - delta` in the file. A graph described in both numberings is
    adopted by a restart whether or not a save came between."""

    lineage: str
    disk_lineage: str
    delta: int

    def aliases(self, lineage: str, first_seq: int) -> list[dict[str, object]]:
        if lineage != self.lineage:  # cleared since the restore: the file names none of it
            return []
        return [{"lineage": self.disk_lineage, "first_seq": first_seq - self.delta}]


class SnapshotStore:
    """Loads the cache from its snapshot at start and saves it when it changed."""

    def __init__(
        self,
        path: Path | None,
        cache: VectorCache,
        model_id: str | None,
        journal: Journal | None = None,
    ) -> None:
        self.cache = cache
        self.model_id = model_id
        #: Set: the changes since the snapshot, replayed after it at start; a save compacts it.
        self.journal = journal
        enabled = path is not None and model_id is not None
        self.status = SnapshotStatus(
            path, SnapshotState.NONE if enabled else SnapshotState.DISABLED
        )
        if path is not None and model_id is None:
            self.status.detail = "no embedder: the cache holds nothing to save"
        self._saved_version: tuple[int, int] | None = None
        self._restored: Numbering | None = None  # while the file keeps the restored numbering
        if enabled and isinstance(cache, IndexedCache):
            cache.on_graph_built = self._save_graph

    @property
    def path(self) -> Path | None:
        return self.status.path if self.status.state is not SnapshotState.DISABLED else None

    def health(self) -> Health:
        """Not degraded either way: the cache works in memory whatever happens to its file."""
        warnings = []
        if self.status.state in (SnapshotState.SET_ASIDE, SnapshotState.ERROR):
            warnings.append(f"cache snapshot {self.status.state.value}: {self.status.detail}")
        if self.status.last_save_error is not None:
            warnings.append(f"cache snapshot not saved: {self.status.last_save_error}")
        if self.journal is not None and self.journal.last_error is not None:
            warnings.append(f"cache journal not written: {self.journal.last_error}")
        return Health(warnings=tuple(warnings))

    def restore(self) -> None:
        """The snapshot, then the journal's changes since it; the journal then takes new ones."""
        path = self.path
        if path is None or self.model_id is None:
            return
        loaded = self._restore_snapshot(path)
        journal = self.journal
        if journal is None:
            return
        replayed = self._replay(journal, journal_generation_of(path) if loaded else 0)
        journal.open()
        if replayed:
            self.status.loaded_vectors = self.cache.size
            log.info(
                "cache journal replayed",
                extra={"path": str(path), "changes": replayed, "vectors": self.cache.size},
            )

    def _replay(self, journal: Journal, from_generation: int) -> int:
        """Applies the journal's changes (runs of adds joined: `extend` is `add` for many)."""
        pending: list[CacheEntries] = []
        replayed = 0

        def flush() -> None:
            if pending:
                self.cache.extend(
                    np.concatenate([p.vectors for p in pending]),
                    np.concatenate([p.added_at_ms for p in pending]),
                    [trace_id for p in pending for trace_id in p.ids()],
                )
                pending.clear()

        for change in journal.replay(from_generation):
            replayed += 1
            if change.entries is None:
                flush()
                self.cache.clear()
            else:
                pending.append(change.entries)
        flush()
        return replayed

    def _restore_snapshot(self, path: Path) -> bool:
        """Whether a snapshot was loaded."""
        for stale in path.parent.glob(f".{path.name}.*.tmp"):
            with contextlib.suppress(OSError):
                stale.unlink()  # left by a crash mid-write; the real snapshot is intact
        if not path.exists():
            log.info("no cache snapshot yet; starting empty", extra={"path": str(path)})
            return False
        assert self.model_id is not None
        try:
            entries = read_snapshot(path, self.model_id, self.cache.dimensions)
        except SnapshotError as exc:
            self._set_aside(path, exc)
            return False
        except OSError as exc:
            self.status.state, self.status.detail = SnapshotState.ERROR, f"cannot read: {exc}"
            log.error(
                "cache snapshot unreadable; starting empty",
                extra={"path": str(path), "error": str(exc)},
            )
            return False
        cache = self.cache
        graph = self._graph_for(path, entries) if isinstance(cache, IndexedCache) else None
        if isinstance(cache, IndexedCache):
            cache.hold_index(graph is not None)  # no build before the graph is adopted
        try:
            self.cache.load(entries)
            if entries.lineage and entries.first_seq is not None:
                _, next_seq = self.cache.sequence_range
                delta = next_seq - len(entries.vectors) - entries.first_seq
                self._restored = Numbering(self.cache.lineage, entries.lineage, delta)
            if graph is not None and isinstance(cache, IndexedCache):
                self._adopt(cache, path, entries, *graph)
        finally:
            if isinstance(cache, IndexedCache):
                cache.hold_index(False)
        self.status.state = SnapshotState.LOADED
        self.status.loaded_vectors = self.cache.size
        self._saved_version = self._version()
        log.info(
            "cache restored from snapshot",
            extra={
                "path": str(path),
                "vectors": self.status.loaded_vectors,
                "graph_adopted": isinstance(cache, IndexedCache)
                and cache.index_adoptions_total > 0,
            },
        )
        return True

    def _graph_for(
        self, path: Path, entries: CacheEntries
    ) -> tuple[AnnIndex, int, dict[str, object]] | None:
        if not graph_paths(path)[1].exists() or self.model_id is None:
            return None
        try:
            return read_graph(path, entries, self.model_id, self.cache.dimensions)
        except SnapshotError as exc:
            log.warning(
                "cache snapshot's graph ignored; the index is built again",
                extra={"path": str(path), "reason": str(exc)},
            )
            return None

    def _adopt(
        self,
        cache: IndexedCache,
        path: Path,
        entries: CacheEntries,
        index: AnnIndex,
        offset: int,
        about: dict[str, object],
    ) -> None:
        """Maps the graph onto the loaded entries (the last of them have the cache's newest
        sequence numbers) and adopts it; its description then names the new numbering and
        the file's (Numbering), so the next restart adopts it again, saved between or not."""
        _, next_seq = cache.sequence_range
        first_id = next_seq - len(entries.vectors) + offset
        why = cache.adopt_index(index, first_id)
        if why is not None:
            log.warning(
                "cache snapshot's graph ignored; the index is built again",
                extra={"path": str(path), "reason": why},
            )
            return
        about = about | {
            "lineage": cache.lineage,
            "first_seq": first_id,
            "aliases": self._aliases(cache.lineage, first_id),
        }
        try:
            _write_graph_description(graph_paths(path)[1], about)
        except OSError as exc:
            log.warning(
                "cache snapshot's graph description not updated; a start after a save builds it",
                extra={"path": str(path), "error": str(exc)},
            )

    def _save_graph(self, built: BuiltGraph) -> None:
        """on_graph_built, in the cache's build or feeder thread: errors are reported, not
        raised."""
        path = self.path
        if path is None or self.model_id is None:
            return
        aliases = self._aliases(built.lineage, built.first_seq)
        try:
            write_graph(path, built, self.model_id, self.cache.dimensions, aliases)
        except OSError as exc:
            log.error(
                "cache graph not saved beside the snapshot; a restart will build it",
                extra={"path": str(path), "error": str(exc)},
            )

    def save(self, *, force: bool = False) -> bool:
        """Write the snapshot if the cache changed since the last save; errors are reported."""
        path = self.path
        if path is None or self.model_id is None:
            return False
        version = self._version()
        if not force and version == self._saved_version:
            return False
        journal, generation = self.journal, None
        try:
            if journal is None:
                chunks = list(self.cache.chunks())
            else:
                # The copy is fixed where the journal starts its next generation: the
                # snapshot holds exactly the older ones' changes.
                with journal.lock:
                    generation = journal.rotate()
                    first, stop = self.cache.sequence_range
                chunks = [
                    chunk
                    for seq in range(first, stop, CHUNK)
                    if len(
                        (chunk := self.cache.entries_between(seq, min(stop, seq + CHUNK))).vectors
                    )
                ]
            chunks = chunks or [self.cache.entries()]  # empty: its shape
            write_snapshot(path, chunks, self.model_id, generation)
        except OSError as exc:
            self.status.save_errors_total += 1
            self.status.last_save_error = f"{exc.strerror or exc} ({path})"
            log.error(
                "cache snapshot not saved; serving continues",
                extra={"error": self.status.last_save_error},
            )
            return False
        if journal is not None and generation is not None:
            journal.drop_before(generation)
        self._saved_version = version
        self._restored = None  # the file now numbers its entries as the cache does
        self.status.saves_total += 1
        self.status.last_saved_at_ms = time.time() * 1000.0
        self.status.last_save_error = None
        return True

    def _aliases(self, lineage: str, first_seq: int) -> list[dict[str, object]]:
        restored = self._restored
        return [] if restored is None else restored.aliases(lineage, first_seq)

    def _version(self) -> tuple[int, int]:
        # Changes with every add and every clear.
        return self.cache.adds_total, self.cache.clears_total

    def _set_aside(self, path: Path, exc: SnapshotError) -> None:
        aside = path.with_name(f"{path.name}.{exc.kind}-{int(time.time())}")
        try:
            os.replace(path, aside)
            detail = f"{exc}; moved to {aside.name}"
        except OSError as move_error:
            detail = f"{exc}; could not move it aside: {move_error}"
        self.status.state, self.status.detail = SnapshotState.SET_ASIDE, detail
        log.error(
            "cache snapshot set aside; starting empty", extra={"path": str(path), "reason": detail}
        )
