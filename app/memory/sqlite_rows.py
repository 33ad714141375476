"""The in-process memory's database below the store (app/memory/sqlite.py): the row format and
its checksums, what a start reads and reports, the kernel's word on the files (FileWatch), and
the moves, syncs and reads of whole files."""

from __future__ import annotations

import contextlib
import functools
import os
import select
import sqlite3
import struct
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from app.core.states import StorageState
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


@functools.cache
def _lanes(d: int) -> npt.NDArray[np.uint32]:
    """The weights of a row's d vector words then its time's two, two lanes each: odd (so a
    change confined to one word always changes the sum), all different (so words swapped
    change it too), fixed: part of the file format."""
    i = np.arange(d + 2, dtype=np.uint64)[:, None]
    seeds = np.array([0x85EBCA6B, 0xC2B2AE35], dtype=np.uint64)
    lanes = (i * seeds + np.uint64(0x9E3779B9)) % np.uint64(2**32) | np.uint64(1)
    return np.ascontiguousarray(lanes.astype(np.uint32))


def checksums(
    words: npt.NDArray[np.uint32], times: npt.NDArray[np.float64], text_crcs: Sequence[int]
) -> npt.NDArray[np.int64]:
    """The 64-bit checksums of rows given as their vectors' little-endian uint32 words (n, d),
    their times and the CRC-32 of their names: two weighted sums modulo 2**32 over the vector's
    and the time's words (numpy, a batch at once), the first XORed with the names' CRC-32."""
    d = words.shape[1]
    lanes = _lanes(d)
    time_words = np.ascontiguousarray(times, dtype="<f8").view("<u4").reshape(-1, 2)
    sums = words @ lanes[:d]  # (n, 2), modulo 2**32
    sums += time_words @ lanes[d:]
    sums[:, 0] ^= np.asarray(text_crcs, dtype=np.uint32)
    # Each (high, low) pair read as one little-endian 64-bit integer: high << 32 | low.
    checksums: npt.NDArray[np.int64] = sums[:, ::-1].astype("<u4").view("<i8")[:, 0]
    return checksums


class FileWatch(NamedTuple):
    """Whether the database's or WAL's file may have been deleted, replaced or moved since it
    was opened. On Linux the kernel queues an event (inotify: a link count changed, the file
    moved or went) before the unlink or rename returns, and `ready.poll(0)` at each commit
    asks for it: 0.7 us against 3.3 us for each of the two stat calls it spares (AMD EPYC, a
    loaded host). The events are read (`inotify.read(timeout=0)`) so that the next asks anew."""

    inotify: Any
    ready: select.poll


def file_watch(paths: Sequence[str]) -> FileWatch | None:
    """None where inotify cannot be had (not Linux, no instance or watch left): the caller
    compares the paths at each commit."""
    try:
        from inotify_simple import INotify, flags  # type: ignore[import-untyped]

        inotify = INotify(nonblocking=True)
    except (ImportError, OSError, AttributeError):
        return None
    try:
        for path in paths:
            inotify.add_watch(path, flags.ATTRIB | flags.MOVE_SELF | flags.DELETE_SELF)
    except OSError:
        inotify.close()
        return None
    ready = select.poll()
    ready.register(inotify.fileno(), select.POLLIN)
    return FileWatch(inotify, ready)


@dataclass(frozen=True, slots=True)
class NewRow:
    namespace: str
    trace_id: str
    added_at_ms: float
    vector: bytes  # little-endian float32


def values(rows: Sequence[NewRow]) -> list[tuple[str, str, float, bytes, int]]:
    """The rows as inserted, with their checksums: checksums' sums, in as few numpy calls (and
    Python calls: a commit is often one row) as can be."""
    if not rows:
        return []
    d = len(rows[0].vector) // 4
    pack = _TIME.pack
    words = np.frombuffer(b"".join([r.vector + pack(r.added_at_ms) for r in rows]), "<u4")
    sums = (words.reshape(len(rows), d + 2) @ _lanes(d)).tolist()
    out = []
    for r, (high, low) in zip(rows, sums, strict=True):
        high ^= zlib.crc32(f"{r.namespace}\x00{r.trace_id}".encode())
        signed = (((high << 32) | low) ^ (1 << 63)) - (1 << 63)  # SQLite's signed INTEGER
        out.append((r.namespace, r.trace_id, r.added_at_ms, r.vector, signed))
    return out


def well_typed(row: Any, size: int) -> bool:
    """Whether a row read at start holds values of the types and vector length the table's."""
    try:
        _, namespace, trace_id, added_at, vector, checksum = row
    except (TypeError, ValueError):
        return False
    return (
        isinstance(namespace, str)
        and isinstance(trace_id, str)
        and isinstance(added_at, float)
        and isinstance(vector, bytes)
        and len(vector) == size
        and isinstance(checksum, int)
    )


def entry_rows(namespace: str, entries: CacheEntries) -> list[NewRow]:
    vectors = np.ascontiguousarray(entries.vectors, dtype="<f4")  # as a row keeps them
    return [
        NewRow(namespace, trace_id, float(at), vector.tobytes())
        for trace_id, at, vector in zip(entries.ids(), entries.added_at_ms, vectors, strict=True)
    ]


def close_quietly(conn: sqlite3.Connection | None) -> None:
    if conn is not None:
        with contextlib.suppress(sqlite3.Error):
            conn.close()


def reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


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
