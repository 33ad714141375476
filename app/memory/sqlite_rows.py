"""The in-process memory's database below the store (app/memory/sqlite.py): the row format and
its checksums, what a start reads and reports, the kernel's word on the files (FileWatch), and
the moves, syncs and reads of whole files."""

from __future__ import annotations

import contextlib
import os
import select
import sqlite3
import struct
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from app.core.states import StorageState
from app.memory.ownership import SQLITE_HEADER
from app.memory.ring import CacheEntries

Durability = Literal["process", "power"]
_TIME = struct.Struct("<d")
#: Row ids read at a time when a damaged file is read row by row.
RECOVER_BLOCK = 256

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS entries (
    id INTEGER PRIMARY KEY,
    namespace TEXT NOT NULL,
    trace_id TEXT NOT NULL,
    added_at_ms REAL NOT NULL,
    vector BLOB NOT NULL,
    checksum INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS entries_by_namespace ON entries (namespace, id);
CREATE TABLE IF NOT EXISTS receipts (
    key TEXT PRIMARY KEY,
    at_ms REAL NOT NULL,
    comparisons TEXT NOT NULL
);
"""
INSERT = (
    "INSERT INTO entries (namespace, trace_id, added_at_ms, vector, checksum) "
    "VALUES (?, ?, ?, ?, ?)"
)
TRIM = (
    "DELETE FROM entries WHERE id IN "
    "(SELECT id FROM entries WHERE namespace = ? ORDER BY id LIMIT ?)"
)
COLUMNS = "id, namespace, trace_id, added_at_ms, vector, checksum"


@dataclass
class StorageStatus:
    """The database, for operators (/readyz, metrics, the log)."""

    path: Path | None
    state: StorageState
    detail: str | None = None  # what happened to the file at start
    loaded_vectors: int = 0
    last_commit_at_ms: float | None = None
    last_write_error: str | None = None  # from a failed write until one succeeds
    commits_total: int = 0
    write_errors_total: int = 0  # failed writes
    checksum_failures_total: int = 0  # rows dropped at start: their checksum failed
    durability: Durability | None = None
    #: Times the database was written anew from the memory: its file or WAL was deleted or
    #: replaced while serving.
    rewrites_total: int = 0

    @property
    def failing(self) -> bool:
        """The database takes no commit now: it could not be opened, or its last write
        failed (traces are scored but not stored)."""
        return self.state is StorageState.ERROR or self.last_write_error is not None


def key_text(namespace: str, trace_id: str) -> bytes:
    return f"{namespace}\x00{trace_id}".encode()


def _weights(words: int, seed: int) -> npt.NDArray[np.uint32]:
    """Odd (so a change confined to one word always changes the sum), all different (so
    words swapped change it too), fixed: part of the file format."""
    i = np.arange(words, dtype=np.uint64)
    return ((i * np.uint64(seed) + np.uint64(0x9E3779B9)) % np.uint64(2**32) | np.uint64(1)).astype(
        np.uint32
    )


#: Per dimension: the weights of the vector's words and of the time's two, two lanes each.
_LANES: dict[int, tuple[npt.NDArray[np.uint32], npt.NDArray[np.uint32]]] = {}
#: The same weights as one (d + 2, 2) matrix: a row's vector words then its time's.
_ROW_LANES: dict[int, npt.NDArray[np.uint32]] = {}


def checksums(
    words: npt.NDArray[np.uint32], times: npt.NDArray[np.float64], text_crcs: Sequence[int]
) -> npt.NDArray[np.int64]:
    """The 64-bit checksums of rows given as their vectors' little-endian uint32 words (n, d),
    their times and the CRC-32 of their names: two weighted sums modulo 2**32 over the vector's
    and the time's words (numpy, a batch at once), the first XORed with the names' CRC-32."""
    d = words.shape[1]
    if d not in _LANES:
        lanes = np.stack([_weights(d + 2, 0x85EBCA6B), _weights(d + 2, 0xC2B2AE35)], axis=1)
        _LANES[d] = (np.ascontiguousarray(lanes[:d]), np.ascontiguousarray(lanes[d:]))
        _ROW_LANES[d] = np.ascontiguousarray(lanes)
    vector_w, time_w = _LANES[d]
    time_words = np.ascontiguousarray(times, dtype="<f8").view("<u4").reshape(-1, 2)
    sums = words @ vector_w  # (n, 2), modulo 2**32
    sums += time_words @ time_w
    sums[:, 0] ^= np.asarray(text_crcs, dtype=np.uint32)
    # Each (high, low) pair read as one little-endian 64-bit integer: high << 32 | low.
    checksums: npt.NDArray[np.int64] = sums[:, ::-1].astype("<u4").view("<i8")[:, 0]
    return checksums


class FileWatch:
    """Whether the database's or WAL's file may have been deleted, replaced or moved since it
    was opened. On Linux the kernel queues an event (inotify: a link count changed, the file
    moved or went) before the unlink or rename returns, and one poll per commit asks for it:
    0.7 us against 3.3 us for each of the two stat calls it spares (AMD EPYC, a loaded host).
    None where inotify cannot be had: the caller compares the paths at each commit."""

    def __init__(self, paths: Sequence[str]) -> None:
        from inotify_simple import INotify, flags  # type: ignore[import-untyped]

        self._inotify = INotify(nonblocking=True)
        try:
            for path in paths:
                self._inotify.add_watch(path, flags.ATTRIB | flags.MOVE_SELF | flags.DELETE_SELF)
        except OSError:
            self._inotify.close()
            raise
        self._poll = select.poll()
        self._poll.register(self._inotify.fileno(), select.POLLIN)

    @classmethod
    def of(cls, paths: Sequence[str]) -> FileWatch | None:
        try:
            return cls(paths)
        except (ImportError, OSError, AttributeError):
            return None  # not Linux, or no inotify instance or watch left: paths compared

    def changed(self) -> bool:
        """An event came (read, so that the next asks anew)."""
        if not self._poll.poll(0):
            return False
        self._inotify.read(timeout=0)
        return True

    def close(self) -> None:
        self._inotify.close()


@dataclass(frozen=True, slots=True)
class NewRow:
    namespace: str
    trace_id: str
    added_at_ms: float
    vector: bytes  # little-endian float32


def values(rows: Sequence[NewRow]) -> list[tuple[str, str, float, bytes, int]]:
    """The rows as inserted, with their checksums: checksums' sums, in as few numpy calls as
    can be (a commit is often one row: each call costs microseconds there)."""
    if not rows:
        return []
    d = len(rows[0].vector) // 4
    if d not in _LANES:
        checksums(np.zeros((1, d), dtype=np.uint32), np.zeros(1), [0])  # makes the weights
    weights = _ROW_LANES[d]
    pack = _TIME.pack
    words = np.frombuffer(b"".join([r.vector + pack(r.added_at_ms) for r in rows]), "<u4")
    sums = (words.reshape(len(rows), d + 2) @ weights).tolist()
    return [
        (r.namespace, r.trace_id, r.added_at_ms, r.vector, signed(h ^ text_crc(r), low))
        for r, (h, low) in zip(rows, sums, strict=True)
    ]


def text_crc(row: NewRow) -> int:
    return zlib.crc32(key_text(row.namespace, row.trace_id))


def signed(high: int, low: int) -> int:
    """high << 32 | low as SQLite's signed 64-bit INTEGER."""
    return (((high << 32) | low) ^ (1 << 63)) - (1 << 63)


Loader = Callable[[str, CacheEntries], None]


class Checked(NamedTuple):
    """A batch of rows read at start: which hold what their checksum says, and their columns."""

    ok: npt.NDArray[np.bool_]
    vectors: npt.NDArray[np.float32]
    times: npt.NDArray[np.float64]
    ids: tuple[int, ...]
    namespaces: tuple[str, ...]
    trace_ids: list[str]


class LoadTarget(Protocol):
    """Where a start's entries go (the memory), and where a database written anew takes them
    from."""

    def load(self, namespace: str, entries: CacheEntries) -> None:
        """The next entries of the namespace, oldest first."""

    def reserve(self, namespace: str, rows: int) -> None:
        """About `rows` entries of the namespace follow."""

    def reset(self) -> None:
        """Forget what was loaded: the file turned out damaged part way, or could not be
        opened after all."""

    def held(self) -> Iterator[tuple[str, CacheEntries]]:
        """Every entry the memory holds, a chunk of one namespace at a time, oldest first."""
        ...


class Discard:
    """A LoadTarget that keeps nothing (tools that only write a database)."""

    def load(self, namespace: str, entries: CacheEntries) -> None:
        pass

    def reserve(self, namespace: str, rows: int) -> None:
        pass

    def reset(self) -> None:
        pass

    def held(self) -> Iterator[tuple[str, CacheEntries]]:
        return iter(())


def row_ok(row: Any, size: int) -> bool:
    try:
        _, namespace, trace_id, added_at, vector, checksum = row
        return bool(
            isinstance(namespace, str)
            and isinstance(trace_id, str)
            and isinstance(added_at, float)
            and isinstance(vector, bytes)
            and len(vector) == size
            and checksum == values([NewRow(namespace, trace_id, added_at, vector)])[0][4]
        )
    except (TypeError, ValueError):
        return False


def wire(vector: npt.NDArray[np.float32]) -> bytes:
    """A vector as a row keeps it: little-endian float32."""
    return np.ascontiguousarray(vector, dtype="<f4").tobytes()


def entry_rows(namespace: str, entries: CacheEntries) -> list[NewRow]:
    times, vectors = entries.added_at_ms, entries.vectors
    return [
        NewRow(namespace, trace_id, float(at), wire(vector))
        for trace_id, at, vector in zip(entries.ids(), times, vectors, strict=True)
    ]


def close_quietly(conn: sqlite3.Connection | None) -> None:
    if conn is not None:
        with contextlib.suppress(sqlite3.Error):
            conn.close()


def reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def has_sqlite_header(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(len(SQLITE_HEADER)) == SQLITE_HEADER


def remove_database(path: Path) -> None:
    for each in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        with contextlib.suppress(FileNotFoundError):
            each.unlink()


def move_database(source: Path, to: Path) -> None:
    """The database renamed, with its WAL and index where there are."""
    os.replace(source, to)
    for suffix in ("-wal", "-shm"):
        with contextlib.suppress(OSError):
            os.replace(Path(f"{source}{suffix}"), Path(f"{to}{suffix}"))


def fsync(path: Path, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def readable_rows(path: Path) -> Iterator[Any]:
    """The entries a damaged database still yields, read a block of ids at a time and,
    where a block fails, one id at a time (a broken page costs only its own rows)."""
    try:
        conn = sqlite3.connect(path, isolation_level=None)
    except sqlite3.Error:
        return
    with contextlib.closing(conn):
        top = None
        with contextlib.suppress(sqlite3.Error):
            top = conn.execute("SELECT max(id) FROM entries").fetchone()[0]
        if top is None:  # unreadable (or no rows): the largest id found walking the table
            top = 0
            with contextlib.suppress(sqlite3.Error):
                for (row_id,) in conn.execute("SELECT id FROM entries ORDER BY id"):
                    top = int(row_id)
        query = f"SELECT {COLUMNS} FROM entries WHERE id BETWEEN ? AND ? ORDER BY id"
        for start in range(1, int(top) + 1, RECOVER_BLOCK):
            stop = start + RECOVER_BLOCK - 1
            try:
                yield from conn.execute(query, (start, stop)).fetchall()
            except sqlite3.Error:
                for one in range(start, stop + 1):
                    with contextlib.suppress(sqlite3.Error):
                        yield from conn.execute(query, (one, one)).fetchall()


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
