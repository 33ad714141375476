"""The in-process memory's persistence: one SQLite database (Python's sqlite3, WAL mode).
Operators: docs/operating/persistence.md; the why and the figures: docs/decisions/
memory-in-sqlite.md and database-files-checked-before-a-commit.md.

Every change is one transaction, committed before its answer (app/memory/in_process.py groups
concurrent requests into one); `KP_CACHE_DURABILITY` is SQLite's `synchronous`: NORMAL (a
process crash loses nothing committed) or FULL (a power loss neither). One table holds every
namespace's entries in the order they were added (its rowid). SQLite checks a file's
structure, not what a row holds, so each row carries a checksum (checksums), checked at start:
a row failing it is never served. The database may hold more rows than the memory (deleted a
batch at a time: `trim_from`); a start keeps the newest of each namespace within the capacity
and the TTL, as the memory does. A damaged file is copied aside and read row by row into a new
one (_recover); another model's is set aside; the former format is converted once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sqlite3
import struct
import time
import zlib
from collections.abc import Collection, Iterable, Sequence
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np

from app.core.config import config_error
from app.core.errors import PartError
from app.core.health import Health
from app.core.states import StorageState
from app.memory.base import RECEIPT_TTL_MS
from app.memory.former_files import FormerFilesError, is_former_snapshot, journal_files, read_former
from app.memory.ownership import (
    SCHEMA_VERSION,
    DatabaseRefusedError,
    OwnerLock,
    newer_schema,
)
from app.memory.ring import CHUNK, CacheEntries
from app.memory.sqlite_rows import (
    COLUMNS,
    INSERT,
    SCHEMA,
    TRIM,
    Checked,
    Durability,
    FileWatch,
    Loader,
    LoadTarget,
    NewRow,
    StorageStatus,
    checksums,
    close_quietly,
    entry_rows,
    fsync,
    has_sqlite_header,
    key_text,
    move_database,
    readable_rows,
    reason,
    remove_database,
    row_ok,
    utc_now,
    values,
)

log = logging.getLogger(__name__)

SYNCHRONOUS: dict[Durability, str] = {"process": "NORMAL", "power": "FULL"}
_TIME = struct.Struct("<d")
#: Pages written to the WAL between two checkpoints (SQLite's own default), counted as a
#: commit's pages: three (the table's, the index's, one they share or a trim's), and one more
#: for every ROWS_A_PAGE rows (two entries of 1.6 KB fill a page of 4 KiB).
CHECKPOINT_PAGES = 1_000
ROWS_A_PAGE = 2
#: How often the lock file is checked (it is not deleted or replaced) between commits, and
#: the database's and WAL's paths where the kernel reports changes to them (FileWatch).
LOCK_CHECK_INTERVAL_S = 1.0
PATH_CHECK_INTERVAL_S = 1.0


class StorageError(PartError):
    """The database could not be written; the message is SQLite's (or the system's) reason."""


class SqliteStore:
    """The database of one process's memory; used by one thread at a time after `open`: the
    memory's in-order thread, or the event loop while that thread is idle.

    A commit is claimed only when it is in the files at the database's path: a database or WAL
    deleted or replaced since it was opened (_files_intact) would take the commit, and those
    it held, with it, so the memory's entries are written anew at the path first (_rewrite).
    One process owns the file (app/memory/ownership.py); a database that cannot be opened is
    tried again before each write."""

    def __init__(self, path: Path, model_id: str, dimensions: int, durability: Durability):
        self.path = path
        self.model_id = model_id
        self.dimensions = dimensions
        self.durability = durability
        self.status = StorageStatus(path, StorageState.NONE, durability=durability)
        self._conn: sqlite3.Connection | None = None
        self._unopened: str | None = None  # why the database could not be opened
        self._rows: dict[str, int] = {}  # rows each namespace holds in the database
        self._start_warnings: list[str] = []
        self._events: list[str] = []  # what happened to the files while serving
        self._counts: dict[str, int] = {}  # rows of each namespace, as the index counts them
        self._bad: list[int] = []  # ids of rows that failed their checksum at start
        self._pages_since_checkpoint = 0
        self._lock = OwnerLock(path)
        self._target: LoadTarget | None = None
        self._path_text, self._wal_text = str(path), f"{path}-wal"
        self._checked_wal = self._wal_text  # the database's own path where WAL mode failed
        self._files: tuple[int, int, int, int] | None = None  # the database's and WAL's ids
        self._watch: FileWatch | None = None
        self._next_path_check = 0.0
        self._rewrite_due = False  # the files were found gone, and not written anew yet
        self._displaced: str | None = None  # another process took the lock
        self._next_lock_check = 0.0
        self._closed = False

    # ── start ───────────────────────────────────────────────────────────────

    def open(self, target: LoadTarget) -> None:
        """Opens (converting, recovering or making) the database and hands its entries to
        `load`, a chunk of one namespace at a time, oldest first. A database that cannot be
        opened leaves the memory empty, every write failing with the reason and /readyz
        warning; it is tried again before each write (ensure_open). ConfigError (the start
        stops) when another process owns the database or a later release wrote it."""
        self._target = target
        try:
            self._open_owned(target)
        except DatabaseRefusedError as exc:
            raise config_error("CACHE_DB_PATH", str(exc)) from None

    @property
    def needs_open(self) -> bool:
        """The database is not open (not yet, or it failed): the next write tries again."""
        return self._conn is None and not self._closed

    def ensure_open(self) -> None:
        """Before a write: opens the database again when it could not be opened (its
        directory made, space back, the other owner gone), loading its entries into the
        memory, which held none meanwhile (nothing is kept that is not committed)."""
        if self._conn is not None or self._closed or self._target is None:
            return
        try:
            self._open_owned(self._target)
        except DatabaseRefusedError as exc:
            self._not_opened(self._target, str(exc))
        if self._conn is not None:
            log.warning(
                "cache database opened: traces are stored again",
                extra={"path": str(self.path), "entries": self.status.loaded_vectors},
            )

    def _open_owned(self, target: LoadTarget) -> None:
        self.status.detail = None
        try:
            self._lock.acquire()
            refused = newer_schema(self.path)
            if refused is not None:
                raise DatabaseRefusedError(refused)
            self._open(target)
            self._record_files()
        except (sqlite3.Error, OSError) as exc:
            self._not_opened(target, reason(exc))
            return
        self._unopened = None
        self.status.last_write_error = None

    def _not_opened(self, target: LoadTarget, reason: str) -> None:
        """What a failed open leaves: no connection, and nothing of the file in the memory
        (a later open loads it whole)."""
        close_quietly(self._conn)
        self._conn = None
        self._reset_loaded(target)
        first = self._unopened != reason
        self._unopened = reason
        self.status.state, self.status.detail = StorageState.ERROR, reason
        self.status.loaded_vectors = 0
        if first:
            log.error(
                "cache database cannot be opened: traces are scored but not stored",
                extra={"path": str(self.path), "reason": reason},
            )

    def _record_files(self) -> None:
        """The identities of the database and its WAL as opened (the WAL exists once the
        connection has read the database, unless SQLite could not use WAL mode there: then
        the database alone), and the kernel's watch on them."""
        if self._watch is not None:
            self._watch.close()
        db = os.stat(self._path_text)
        self._checked_wal = self._wal_text
        try:
            wal = os.stat(self._wal_text)
        except FileNotFoundError:
            self._checked_wal, wal = self._path_text, db
        self._watch = FileWatch.of(sorted({self._path_text, self._checked_wal}))
        self._files = (db.st_dev, db.st_ino, wal.st_dev, wal.st_ino)
        self._next_path_check = time.monotonic() + PATH_CHECK_INTERVAL_S

    def _files_intact(self) -> bool:
        """The database and the WAL at the path are the ones this connection writes: the
        kernel's word (one poll) at each commit, and the paths compared (two stat calls) when
        it reports a change, once a second besides (a network file system's change made on
        another host), and at each commit where there is no watch."""
        watch = self._watch
        if watch is not None and not watch.changed():
            if time.monotonic() < self._next_path_check:
                return True
            self._next_path_check = time.monotonic() + PATH_CHECK_INTERVAL_S
        try:
            db, wal = os.stat(self._path_text), os.stat(self._checked_wal)
        except OSError:
            return False
        return (db.st_dev, db.st_ino, wal.st_dev, wal.st_ino) == self._files

    def _open(self, target: LoadTarget) -> None:
        path = self.path
        if path.exists() and is_former_snapshot(path):
            self._convert(target)
            return
        if path.exists() and path.stat().st_size and not has_sqlite_header(path):
            self._recover(target, "not an SQLite database")
            return
        conn: sqlite3.Connection | None = None
        try:
            conn = self._connect(path)
            other = self._other_model(conn)
            if other is None:
                # Every page of the index and of the table is read: a damaged one fails the
                # read (SQLITE_CORRUPT), or the two disagree on the count.
                self._counts = counts = dict(
                    conn.execute(
                        "SELECT namespace, count(*) FROM entries INDEXED BY "
                        "entries_by_namespace GROUP BY namespace"
                    ).fetchall()
                )
                loaded = self._load_rows(conn, target)
                if loaded + self.status.checksum_failures_total != sum(counts.values()):
                    raise sqlite3.DatabaseError(
                        f"the index counts {sum(counts.values())} entries, the table "
                        f"{loaded + self.status.checksum_failures_total}"
                    )
        except sqlite3.DatabaseError as exc:  # SQLITE_CORRUPT, SQLITE_NOTADB
            close_quietly(conn)
            if isinstance(exc, sqlite3.OperationalError):
                raise  # not damage: the file cannot be opened or is busy (open() reports it)
            self._reset_loaded(target)
            self._recover(target, reason(exc))
            return
        assert conn is not None
        if other is not None:
            conn.close()
            self._set_aside(other)
            self._conn = self._connect(path, meta=True)
            return
        self._conn = conn  # closed by _not_opened if what follows fails
        self._write_meta(conn)
        self._drop(conn, self._bad)
        self.status.state = StorageState.LOADED if loaded else StorageState.NONE
        self.status.loaded_vectors = loaded
        log.info("cache database opened", extra={"path": str(path), "entries": loaded})

    def _connect(self, path: Path, *, meta: bool = False) -> sqlite3.Connection:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={SYNCHRONOUS[self.durability]}")
        # Checkpoints (an fsync at `process`) run on the memory's thread, never inside a
        # commit that may run on the event loop (checkpoint()).
        conn.execute("PRAGMA wal_autocheckpoint=0")
        conn.executescript(SCHEMA)
        if meta:
            self._write_meta(conn)
        return conn

    def _write_meta(self, conn: sqlite3.Connection) -> None:
        """The database's identity, written only where it differs: a database whose disk is
        full opens (and serves what it holds) all the same."""
        meta = [
            ("schema", str(SCHEMA_VERSION)),
            ("model", self.model_id),
            ("dimensions", str(self.dimensions)),
        ]
        if dict(conn.execute("SELECT key, value FROM meta").fetchall()) != dict(meta):
            conn.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", meta)

    def _other_model(self, conn: sqlite3.Connection) -> str | None:
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
        model, dimensions = meta.get("model"), meta.get("dimensions")
        if model is None or (model == self.model_id and dimensions == str(self.dimensions)):
            return None
        return (
            f"the database is from model {model} ({dimensions} dimensions); this service runs "
            f"{self.model_id} ({self.dimensions} dimensions)"
        )

    def _load_rows(self, conn: sqlite3.Connection, target: LoadTarget) -> int:
        """Every good row to `target`, a chunk per namespace; the ids of bad ones kept (and
        counted) for _drop."""
        for namespace, count in self._counts.items():
            target.reserve(namespace, count)
        rows = conn.execute(f"SELECT {COLUMNS} FROM entries ORDER BY id")
        try:
            self._bad = self._dispatch(iter(lambda: rows.fetchmany(CHUNK), []), target.load)
        except sqlite3.OperationalError as exc:
            if "decode" not in str(exc):
                raise
            # A byte changed in a name so that it is no longer UTF-8: damage, read row by row.
            raise sqlite3.DatabaseError(str(exc)) from exc
        return sum(self._rows.values())

    def _drop(self, conn: sqlite3.Connection, bad: list[int]) -> None:
        """Deletes the rows that failed their checksum (they are never served)."""
        if bad:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("BEGIN IMMEDIATE")
                conn.executemany("DELETE FROM entries WHERE id = ?", [(b,) for b in bad])
                conn.execute("COMMIT")

    def _reset_loaded(self, target: LoadTarget) -> None:
        self._rows.clear()
        self._bad = []
        self.status.checksum_failures_total = 0
        self._start_warnings.clear()
        target.reset()

    def _dispatch(self, batches: Iterable[list[Any]], load: Loader) -> list[int]:
        """Rows (id, namespace, trace_id, added_at_ms, vector, checksum) to `load`, checked
        a batch at a time; the ids of those that fail their checksum (or hold a vector that
        is not finite: a checksum of a bad vector is no proof)."""
        bad: list[int] = []
        for batch in batches:
            if not batch:
                continue
            checked = self._checked_batch(batch)
            if checked is None:  # a value of another type or length somewhere
                good = [row_ok(r, self.dimensions * 4) for r in batch]
                bad.extend(r[0] for r, ok in zip(batch, good, strict=True) if not ok)
                batch = [r for r, ok in zip(batch, good, strict=True) if ok]
                checked = self._checked_batch(batch) if batch else None
                if checked is None:
                    bad.extend(r[0] for r in batch)
                    continue
            ok, vectors, times, ids, namespaces, trace_ids = checked
            if not ok.all():
                bad.extend(i for i, good_row in zip(ids, ok.tolist(), strict=True) if not good_row)
            first = namespaces[0]
            if ok.all() and namespaces.count(first) == len(namespaces):  # the common case
                self._loaded(load, first, CacheEntries(vectors, times, trace_ids))
                continue
            names = np.array(namespaces, dtype=object)
            for namespace in dict.fromkeys(namespaces):
                keep = ok & (names == namespace)
                if keep.any():
                    at = np.flatnonzero(keep)
                    entries = CacheEntries(vectors[at], times[at], [trace_ids[i] for i in at])
                    self._loaded(load, namespace, entries)
        if bad:
            self.status.checksum_failures_total += len(bad)
            warning = (
                f"cache database: {len(bad)} entries failed their checksum at start and were "
                "dropped (never served)"
            )
            self._start_warnings.append(warning)
            log.error(warning, extra={"path": str(self.path), "dropped": len(bad)})
        return bad

    def _loaded(self, load: Loader, namespace: str, entries: CacheEntries) -> None:
        self._rows[namespace] = self._rows.get(namespace, 0) + len(entries.vectors)
        load(namespace, entries)

    def _checked_batch(self, batch: list[Any]) -> Checked | None:
        """Whether each row holds what its checksum says, with the rows' columns; None when
        a value is of another type or length (the caller checks row by row)."""
        n, size = len(batch), self.dimensions * 4
        # Column by column, in C where it can be (a million rows at a start).
        ids, namespaces, trace_ids, times_of, blobs, stored_of = zip(*batch, strict=True)
        try:
            blob = b"".join(blobs)
            if len(blob) != n * size or set(map(type, times_of)) != {float}:
                return None
            first = namespaces[0]
            if namespaces.count(first) == n:
                names = repeat(zlib.crc32(f"{first}\x00".encode()), n)
                text = list(map(zlib.crc32, map(str.encode, trace_ids), names))
            else:
                text = list(map(zlib.crc32, map(key_text, namespaces, trace_ids)))
            stored = np.array(stored_of, dtype=np.int64)
        except (TypeError, AttributeError, ValueError, OverflowError):
            return None
        times = np.array(times_of, dtype=np.float64)
        sums = checksums(np.frombuffer(blob, "<u4").reshape(n, self.dimensions), times, text)
        vectors = np.frombuffer(blob, "<f4").reshape(n, self.dimensions)
        ok = (sums == stored) & np.isfinite(vectors).all(axis=1)
        return Checked(ok, vectors, times, ids, namespaces, list(trace_ids))

    def _recover(self, target: LoadTarget, why: str) -> None:
        """Copies the damaged file aside byte for byte, keeps what can be read of it row by
        row in a new database, and says how many (log, health until the next start)."""
        path = self.path
        aside = path.with_name(f"{path.name}.damaged-{int(time.time())}")
        shutil.copyfile(path, aside)
        for suffix in ("-wal", "-shm"):
            extra = Path(f"{path}{suffix}")
            if extra.exists():
                shutil.copyfile(extra, Path(f"{aside}{suffix}"))
        scratch = path.with_name(f"{path.name}.reading")
        rows: list[Any] = []
        try:
            shutil.copyfile(path, scratch)
            wal = Path(f"{path}-wal")
            if wal.exists():
                shutil.copyfile(wal, Path(f"{scratch}-wal"))
            rows = list(readable_rows(scratch))
        finally:
            for leftover in (scratch, Path(f"{scratch}-wal"), Path(f"{scratch}-shm")):
                with contextlib.suppress(OSError):
                    leftover.unlink()
        remove_database(path)
        conn = self._connect(path, meta=True)
        kept: list[tuple[str, str, float, bytes, int]] = []

        def keep(namespace: str, entries: CacheEntries) -> None:
            kept.extend(values(entry_rows(namespace, entries)))
            target.load(namespace, entries)

        self._dispatch([rows[i : i + CHUNK] for i in range(0, len(rows), CHUNK)], keep)
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(INSERT, kept)
        conn.execute("COMMIT")
        self._conn = conn
        detail = (
            f"the database was damaged ({why}); copied to {aside.name}; "
            f"{len(kept)} entries kept of {len(rows)} readable rows"
        )
        self.status.state, self.status.detail = StorageState.RECOVERED, detail
        self.status.loaded_vectors = len(kept)
        self._start_warnings.append(f"cache database recovered at start: {detail}")
        log.error(
            "cache database damaged: what could be read was kept",
            extra={"path": str(path), "aside": str(aside), "kept": len(kept), "reason": why},
        )

    def _convert(self, target: LoadTarget) -> None:
        """The former snapshot and journal, read once into a new database; the former files
        kept beside it (`<name>.old-format`)."""
        path = self.path
        aside = path.with_name(f"{path.name}.old-format")
        try:
            former = read_former(path, self.model_id, self.dimensions)
        except (FormerFilesError, OSError, ValueError) as exc:
            os.replace(path, aside)
            for _, journal in journal_files(path):
                os.replace(journal, journal.with_name(f"{journal.name}.old-format"))
            message = (
                f"the former snapshot at {path.name} cannot be converted ({exc}); kept as "
                f"{aside.name}: export it with the former release (GET /cache/export) and "
                "import it here (POST /cache/import)"
            )
            self.status.state, self.status.detail = StorageState.SET_ASIDE, message
            self._start_warnings.append(message)
            log.error("cache snapshot not converted", extra={"reason": message})
            self._conn = self._connect(path, meta=True)
            return
        building = path.with_name(f"{path.name}.converting")
        remove_database(building)
        conn = self._connect(building, meta=True)
        e, ids = former.entries, former.entries.ids()
        conn.execute("BEGIN IMMEDIATE")
        for i in range(0, len(e.vectors), CHUNK):
            at = slice(i, i + CHUNK)
            part = CacheEntries(e.vectors[at], e.added_at_ms[at], ids[at])
            conn.executemany(INSERT, values(entry_rows("default", part)))
        conn.execute("COMMIT")
        conn.close()
        shutil.copyfile(path, aside)  # beside it before the database takes its name
        fsync(aside)
        move_database(building, path)
        for _, journal in journal_files(path):
            os.replace(journal, journal.with_name(f"{journal.name}.old-format"))
        self._conn = self._connect(path)
        loaded = self._load_rows(self._conn, target)
        self._drop(self._conn, self._bad)
        self.status.state = StorageState.CONVERTED
        self.status.loaded_vectors = loaded
        self.status.detail = (
            f"converted from the former snapshot and journal ({len(e.vectors)} entries, "
            f"{former.records_dropped} journal records cut short); kept as {aside.name}"
        )
        log.warning(
            "cache snapshot converted to the database",
            extra={"path": str(path), "entries": loaded, "former": str(aside)},
        )

    def _set_aside(self, why: str) -> None:
        path = self.path
        aside = path.with_name(f"{path.name}.other_model-{int(time.time())}")
        move_database(path, aside)
        detail = f"{why}; moved to {aside.name}"
        self.status.state, self.status.detail = StorageState.SET_ASIDE, detail
        self._start_warnings.append(f"cache database set aside: {detail}")
        log.error("cache database set aside; starting empty", extra={"reason": detail})

    # ── writes ──────────────────────────────────────────────────────────────

    def rows(self, namespace: str) -> int:
        return self._rows.get(namespace, 0)

    def receipt(self, key: str) -> str | None:
        """The comparisons a commit kept under `key` (write's `receipts`), or None: none, or
        one past RECEIPT_TTL_MS, or the database cannot be read (the caller compares anew)."""
        if self._conn is None:
            return None
        oldest = time.time() * 1000.0 - RECEIPT_TTL_MS
        try:
            found = self._conn.execute(
                "SELECT comparisons FROM receipts WHERE key = ? AND at_ms >= ?", (key, oldest)
            ).fetchone()
        except sqlite3.Error:
            return None
        return None if found is None else str(found[0])

    def rows_by_namespace(self) -> dict[str, int]:
        """The rows the database holds, of each namespace that has some."""
        return {namespace: rows for namespace, rows in self._rows.items() if rows}

    def write(
        self,
        rows: Sequence[NewRow] = (),
        *,
        held: dict[str, int] | None = None,
        clear: str | None = None,
        forget: Collection[str] = (),
        checkpoint: bool = True,
        trim_from: int = 1,
        receipts: Sequence[tuple[str, str]] = (),
    ) -> None:
        """One transaction, committed (StorageError, nothing changed, when it cannot be): every
        row of `clear` and of each of `forget` (namespaces the memory let go) deleted; for each
        namespace in `held` (its entries in the memory before `rows`), the rows the memory no
        longer holds deleted oldest first, once at least `trim_from`; `rows` appended;
        `receipts` (key, comparisons as text) kept for RECEIPT_TTL_MS (older ones go).
        `checkpoint`: one that is due runs after the commit (False on the event loop: the
        memory runs it on its thread). Claimed only when it is in the files at the path, else
        written into a new database first (_rewrite)."""
        conn = self._conn
        if conn is None:
            self._failed(self._unopened or "the database is not open")
        assert conn is not None
        if self._displaced is not None or time.monotonic() >= self._next_lock_check:
            self._check_lock()
        gone = set(forget)
        if clear is not None:
            gone.add(clear)
        if self._rewrite_due:
            self._rewrite(rows, gone, receipts)
        else:
            trims = {
                ns: self.rows(ns) - kept
                for ns, kept in (held or {}).items()
                if ns not in gone and self.rows(ns) - kept >= max(1, trim_from)
            }
            try:
                conn.execute("BEGIN IMMEDIATE")
                for namespace, excess in trims.items():
                    conn.execute(TRIM, (namespace, excess))
                for namespace in gone:
                    conn.execute("DELETE FROM entries WHERE namespace = ?", (namespace,))
                conn.executemany(INSERT, values(rows))
                if receipts:
                    now = time.time() * 1000.0
                    conn.execute("DELETE FROM receipts WHERE at_ms < ?", (now - RECEIPT_TTL_MS,))
                    conn.executemany(
                        "INSERT OR REPLACE INTO receipts VALUES (?, ?, ?)",
                        [(key, now, text) for key, text in receipts],
                    )
                conn.execute("COMMIT")
            except (sqlite3.Error, OSError) as exc:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
                self._failed(reason(exc))
            if not self._files_intact():
                self._rewrite_due = True
                self._rewrite(rows, gone, receipts)
            else:
                for namespace, excess in trims.items():
                    self._rows[namespace] -= excess
                for namespace in gone:
                    self._rows.pop(namespace, None)
                for row in rows:
                    self._rows[row.namespace] = self._rows.get(row.namespace, 0) + 1
        status = self.status
        if status.last_write_error is not None:
            log.warning("cache database written again", extra={"path": str(self.path)})
        status.last_write_error = None
        status.commits_total += 1
        status.last_commit_at_ms = time.time() * 1000.0
        self._pages_since_checkpoint += 3 + len(rows) // ROWS_A_PAGE
        if checkpoint and self.checkpoint_due:
            self.checkpoint()

    def _check_lock(self) -> None:
        """The lock file deleted or replaced (another process could then take a new one):
        locked again; when another process holds it now, this one stores nothing until it
        can lock it again (StorageError naming the other)."""
        self._next_lock_check = time.monotonic() + LOCK_CHECK_INTERVAL_S
        if self._displaced is None and self._lock.intact():
            return
        if self._lock.held:
            self._lock.release()
            log.error(
                "cache database lock file deleted or replaced: locking it again",
                extra={"path": str(self._lock.path)},
            )
        try:
            self._lock.acquire()
        except DatabaseRefusedError as exc:
            self._displaced = f"the lock file was deleted while serving, and then {exc}"
        except OSError as exc:
            self._displaced = f"its lock file cannot be made again: {reason(exc)}"
        else:
            self._displaced = None
        if self._displaced is not None:
            self._failed(self._displaced)

    def _rewrite(
        self,
        rows: Sequence[NewRow],
        gone: Collection[str],
        receipts: Sequence[tuple[str, str]] = (),
    ) -> None:
        """The database or its WAL was deleted or replaced while serving (its commits survive
        no crash): what the memory holds (but the namespaces `gone`) and `rows` are written
        into a new database built beside the path and renamed into it (a crash meanwhile loses
        nothing more than the operator's act did); files at the path that are not this
        process's are moved aside, never deleted. StorageError when it cannot be written
        (tried again at the next write)."""
        target = self._target
        assert target is not None
        path = self.path
        building = path.with_name(f"{path.name}.rewriting")
        counts: dict[str, int] = {}
        conn: sqlite3.Connection | None = None
        aside: str | None = None
        try:
            remove_database(building)
            conn = self._connect(building, meta=True)
            conn.execute("BEGIN IMMEDIATE")
            for namespace, chunk in target.held():
                if namespace in gone:
                    continue
                conn.executemany(INSERT, values(entry_rows(namespace, chunk)))
                counts[namespace] = counts.get(namespace, 0) + len(chunk.vectors)
            conn.executemany(INSERT, values(rows))
            for row in rows:
                counts[row.namespace] = counts.get(row.namespace, 0) + 1
            now = time.time() * 1000.0
            conn.executemany(
                "INSERT OR REPLACE INTO receipts VALUES (?, ?, ?)",
                [(key, now, text) for key, text in receipts],
            )
            conn.execute("COMMIT")
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            conn.close()  # the last connection: its WAL folded in and deleted
            conn = None
            if self.durability == "power":
                fsync(building)
            aside = self._move_foreign_aside()
            # The WAL and index of the file that went: never beside the new database.
            for stale in (self._wal_text, f"{path}-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(stale)
            os.replace(building, path)
            if self.durability == "power":  # so that the rename survives a power loss
                fsync(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        except (sqlite3.Error, OSError) as exc:
            close_quietly(conn)
            with contextlib.suppress(OSError):
                remove_database(building)
            self._failed(
                "the database file or its WAL was deleted or replaced while serving, and it "
                f"cannot be written anew: {reason(exc)}"
            )
        # The old files are no longer at the path: what it still writes at close goes nowhere.
        close_quietly(self._conn)
        self._conn = None
        try:
            self._conn = self._connect(path)
            self._record_files()
        except (sqlite3.Error, OSError) as exc:
            self._not_opened(target, reason(exc))
            self._failed(self._unopened or reason(exc))
        self._rows = counts
        self._rewrite_due = False
        self._pages_since_checkpoint = 0
        self.status.rewrites_total += 1
        entries = sum(counts.values())
        moved = f"; the file found there was moved to {aside}" if aside else ""
        event = (
            f"cache database written anew at {utc_now()}: its file or WAL was "
            f"deleted or replaced while serving; the {entries} entries the memory holds were "
            f"written to a new file{moved}"
        )
        self._events = [*self._events[-4:], event]
        log.error(
            "cache database file deleted or replaced while serving: written anew",
            extra={"path": str(path), "entries": entries, "moved_aside": aside},
        )

    def _move_foreign_aside(self) -> str | None:
        """Files at the database's and WAL's paths that are not the ones this process opened
        (an operator's copy put in place): renamed beside it. Their name, or None."""
        assert self._files is not None
        stamp = int(time.time())
        aside = None
        for name, expected, suffix in (
            (self._path_text, self._files[:2], ""),
            (self._checked_wal, self._files[2:], "-wal"),
        ):
            try:
                found = os.stat(name)
            except FileNotFoundError:
                continue
            if (found.st_dev, found.st_ino) != expected:
                moved = f"{self.path.name}.replaced-{stamp}{suffix}"
                os.replace(name, self.path.with_name(moved))
                aside = aside or moved
        return aside

    def _failed(self, reason: str) -> None:
        status = self.status
        if status.last_write_error is None:
            log.error(
                "cache database not written: traces are scored but not stored",
                extra={"path": str(self.path), "reason": reason},
            )
        status.last_write_error = reason
        status.write_errors_total += 1
        raise StorageError(reason)

    @property
    def checkpoint_due(self) -> bool:
        """The WAL holds about SQLite's default of 1,000 pages since the last checkpoint."""
        return self._pages_since_checkpoint >= CHECKPOINT_PAGES

    def checkpoint(self) -> None:
        """Copies the WAL into the database (PASSIVE: never waits), syncing both: on the
        memory's thread, never inside a commit on the event loop."""
        self._pages_since_checkpoint = 0
        if self._conn is not None:
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)")

    def close(self) -> None:
        self._closed = True
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        close_quietly(self._conn)
        self._conn = None
        self._lock.release()

    def health(self) -> Health:
        """Warnings, never degraded: novelty is measured whatever the file does."""
        warnings = [*self._start_warnings, *self._events]
        if self.needs_open and self._unopened is not None:
            warnings.append(
                f"cache database cannot be opened: {self._unopened} (traces are scored but not "
                "stored, novelty.stored is false; it is tried again at each trace)"
            )
        elif self.status.last_write_error is not None:
            warnings.append(
                f"cache database not written: {self.status.last_write_error} (traces are "
                "scored but not stored, novelty.stored is false)"
            )
        return Health(warnings=tuple(warnings))
