"""The in-process memory's persistence: one SQLite database (Python's sqlite3, WAL mode), one
table of every namespace's entries in the order added, each row with a checksum checked at start
(SQLite checks a file's structure, not what a row holds). Every change is one transaction,
committed before its answer. A damaged file is copied aside and read row by row into a new one,
another model's is set aside, the former format is converted once. Operators:
docs/operating/persistence.md; why: docs/decisions/memory-in-sqlite.md and
database-files-checked-before-a-commit.md."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sqlite3
import time
import zlib
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from itertools import repeat
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from app.core.config import config_error
from app.core.errors import PartError
from app.core.health import Health
from app.core.states import StorageState
from app.memory.base import RECEIPT_TTL_MS
from app.memory.former_files import FormerFilesError, is_former_snapshot, journal_files, read_former
from app.memory.ownership import (
    SCHEMA_VERSION,
    SQLITE_HEADER,
    DatabaseRefusedError,
    OwnerLock,
    newer_schema,
    utc_now,
)
from app.memory.ring import CHUNK, CacheEntries
from app.memory.sqlite_rows import (
    COLUMNS,
    INSERT,
    SCHEMA,
    TRIM,
    Durability,
    FileWatch,
    NewRow,
    StorageStatus,
    checksums,
    close_quietly,
    entry_rows,
    file_watch,
    fsync,
    key_text,
    move_database,
    readable_rows,
    reason,
    remove_database,
    values,
    well_typed,
)

log = logging.getLogger(__name__)

SYNCHRONOUS: dict[Durability, str] = {"process": "NORMAL", "power": "FULL"}
#: Pages written to the WAL between two checkpoints (SQLite's own default), counted as a
#: commit's pages: three (the table's, the index's, one they share or a trim's), and one more
#: for every ROWS_A_PAGE rows (two entries of 1.6 KB fill a page of 4 KiB).
CHECKPOINT_PAGES = 1_000
ROWS_A_PAGE = 2
#: How often the lock file is checked (it is not deleted or replaced) between commits, and
#: the database's and WAL's paths where the kernel reports changes to them (FileWatch).
CHECK_INTERVAL_S = 1.0


class LoadTarget(Protocol):
    """Where a start's entries go, and where a database written anew takes them from: the
    memory (app/memory/in_process.py, which imports this module)."""

    def load(self, namespace: str, entries: CacheEntries) -> None: ...
    def reserve(self, namespace: str, rows: int) -> None: ...
    def reset(self) -> None: ...
    def held(self) -> Iterator[tuple[str, CacheEntries]]: ...


class StorageError(PartError):
    """The database could not be written; the message is SQLite's (or the system's) reason."""


class SqliteStore:
    """The database of one process's memory; used by one thread at a time after `open`: the
    memory's in-order thread, or the event loop while that thread is idle. A commit is claimed
    only when it is in the files at the database's path (else they are written anew first:
    _rewrite); a database that cannot be opened is tried again before each write."""

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
        self._pages_since_checkpoint = 0
        self._lock = OwnerLock(path)
        self._memory: LoadTarget | None = None  # where the entries are loaded (open)
        self._path_text, self._wal_text = str(path), f"{path}-wal"
        self._checked_wal = self._wal_text  # the database's own path where WAL mode failed
        self._files: tuple[int, int, int, int] | None = None  # the database's and WAL's ids
        self._watch: FileWatch | None = None  # the kernel's word on them
        self._next_path_check = 0.0
        self._rewrite_due = False  # the files were found gone, and not written anew yet
        self._displaced: str | None = None  # another process took the lock
        self._next_lock_check = 0.0
        self._closed = False

    # ── start ───────────────────────────────────────────────────────────────

    def open(self, memory: LoadTarget) -> None:
        """Opens (converting, recovering or making) the database and loads its entries into
        `memory`, a chunk of one namespace at a time, oldest first. A database that cannot be
        opened leaves the memory empty, every write failing with the reason and /readyz
        warning; it is tried again before each write (ensure_open). ConfigError (the start
        stops) when another process owns the database or a later release wrote it."""
        self._memory = memory
        try:
            self._open_owned()
        except DatabaseRefusedError as exc:
            raise config_error("CACHE_DB_PATH", str(exc)) from None

    @property
    def commit_waits(self) -> bool:
        """The next commit runs on the memory's thread: it syncs (`power`), a checkpoint is
        due, or the database is to be opened (and loaded) first."""
        return (
            self.durability != "process"
            or self._pages_since_checkpoint >= CHECKPOINT_PAGES
            or (self._conn is None and not self._closed)
        )

    def ensure_open(self) -> None:
        """Before a write: opens the database again when it could not be opened (its
        directory made, space back, the other owner gone), loading its entries into the
        memory, which held none meanwhile (nothing is kept that is not committed)."""
        if self._conn is not None or self._closed or self._memory is None:
            return
        try:
            self._open_owned()
        except DatabaseRefusedError as exc:
            self._not_opened(str(exc))
        if self._conn is not None:
            log.warning(
                "cache database opened: traces are stored again",
                extra={"path": str(self.path), "entries": self.status.loaded_vectors},
            )

    def _open_owned(self) -> None:
        self.status.detail = None
        try:
            self._lock.acquire()
            refused = newer_schema(self.path)
            if refused is not None:
                raise DatabaseRefusedError(refused)
            self._open()
            self._record_files()
        except (sqlite3.Error, OSError) as exc:
            self._not_opened(reason(exc))
            return
        self._unopened = None
        self.status.last_write_error = None

    def _not_opened(self, reason: str) -> None:
        """What a failed open leaves: no connection, and nothing of the file in the memory
        (a later open loads it whole)."""
        close_quietly(self._conn)
        self._conn = None
        self._reset_loaded()
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
            self._watch.inotify.close()
        db = os.stat(self._path_text)
        self._checked_wal = self._wal_text
        try:
            wal = os.stat(self._wal_text)
        except FileNotFoundError:
            self._checked_wal, wal = self._path_text, db
        self._watch = file_watch(sorted({self._path_text, self._checked_wal}))
        self._files = (db.st_dev, db.st_ino, wal.st_dev, wal.st_ino)
        self._next_path_check = time.monotonic() + CHECK_INTERVAL_S

    def _files_intact(self) -> bool:
        """The database and the WAL at the path are the ones this connection writes, their
        paths compared (two stat calls): when the kernel reported a change, once a second
        besides (a network file system's change made on another host), and at each commit
        where there is no watch (write)."""
        if self._watch is not None:
            self._watch.inotify.read(timeout=0)  # so that the next poll asks anew
        self._next_path_check = time.monotonic() + CHECK_INTERVAL_S
        try:
            db, wal = os.stat(self._path_text), os.stat(self._checked_wal)
        except OSError:
            return False
        return (db.st_dev, db.st_ino, wal.st_dev, wal.st_ino) == self._files

    def _open(self) -> None:
        path = self.path
        if path.exists() and is_former_snapshot(path):
            self._convert()
            return
        if path.exists() and path.stat().st_size:
            with path.open("rb") as f:
                header = f.read(len(SQLITE_HEADER))
            if header != SQLITE_HEADER:
                self._recover("not an SQLite database")
                return
        memory = self._memory
        assert memory is not None
        conn: sqlite3.Connection | None = None
        try:
            conn = self._connect(path)
            meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
            model, dimensions = meta.get("model"), meta.get("dimensions")
            other = model is not None and (model, dimensions) != (
                self.model_id,
                str(self.dimensions),
            )
            if not other:
                # Every page of the index and of the table is read: a damaged one fails the
                # read (SQLITE_CORRUPT), or the two disagree on the count.
                counts = dict(
                    conn.execute(
                        "SELECT namespace, count(*) FROM entries INDEXED BY "
                        "entries_by_namespace GROUP BY namespace"
                    ).fetchall()
                )
                for namespace, count in counts.items():
                    memory.reserve(namespace, count)
                rows = conn.execute(f"SELECT {COLUMNS} FROM entries ORDER BY id")
                try:
                    bad = self._dispatch(iter(lambda: rows.fetchmany(CHUNK), []), memory.load)
                except sqlite3.OperationalError as exc:
                    if "decode" not in str(exc):
                        raise
                    # A byte changed in a name (no longer UTF-8): damage, read row by row.
                    raise sqlite3.DatabaseError(str(exc)) from exc
                loaded = sum(self._rows.values())
                if loaded + len(bad) != sum(counts.values()):
                    raise sqlite3.DatabaseError(
                        f"the index counts {sum(counts.values())} entries, the table "
                        f"{loaded + len(bad)}"
                    )
        except sqlite3.DatabaseError as exc:  # SQLITE_CORRUPT, SQLITE_NOTADB
            close_quietly(conn)
            if isinstance(exc, sqlite3.OperationalError):
                raise  # not damage: the file cannot be opened or is busy (open() reports it)
            self._reset_loaded()
            self._recover(reason(exc))
            return
        assert conn is not None
        if other:
            conn.close()
            aside = path.with_name(f"{path.name}.other_model-{int(time.time())}")
            move_database(path, aside)
            detail = (
                f"the database is from model {model} ({dimensions} dimensions); this service "
                f"runs {self.model_id} ({self.dimensions} dimensions); moved to {aside.name}"
            )
            self.status.state, self.status.detail = StorageState.SET_ASIDE, detail
            self._start_warnings.append(f"cache database set aside: {detail}")
            log.error("cache database set aside; starting empty", extra={"reason": detail})
            self._conn = self._connect(path, meta=True)
            return
        self._conn = conn  # closed by _not_opened if what follows fails
        self._write_meta(conn)
        if bad:  # rows that failed their checksum: never served
            with contextlib.suppress(sqlite3.Error):
                conn.execute("BEGIN IMMEDIATE")
                conn.executemany("DELETE FROM entries WHERE id = ?", [(b,) for b in bad])
                conn.execute("COMMIT")
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

    def _reset_loaded(self) -> None:
        self._rows.clear()
        self.status.checksum_failures_total = 0
        self._start_warnings.clear()
        if self._memory is not None:
            self._memory.reset()

    def _dispatch(
        self, batches: Iterable[list[Any]], load: Callable[[str, CacheEntries], None]
    ) -> list[int]:
        """Rows (id, namespace, trace_id, added_at_ms, vector, checksum) to `load`, checked
        a batch at a time; the ids of those that fail their checksum (or hold a vector that
        is not finite: a checksum of a bad vector is no proof)."""
        bad: list[int] = []
        for batch in batches:
            checked = self._checked_batch(batch) if batch else None
            if checked is None and batch:  # a value of another type or length somewhere
                bad.extend(r[0] for r in batch if not well_typed(r, self.dimensions * 4))
                batch = [r for r in batch if well_typed(r, self.dimensions * 4)]
                checked = self._checked_batch(batch) if batch else None
                if checked is None:  # not one of them loaded: each counted as bad
                    bad.extend(r[0] for r in batch)
            if checked is None:
                continue
            ok, vectors, times, ids, namespaces, trace_ids = checked
            if not ok.all():
                bad.extend(i for i, good_row in zip(ids, ok.tolist(), strict=True) if not good_row)
            first = namespaces[0]
            if ok.all() and namespaces.count(first) == len(namespaces):  # the common case
                parts = [(first, CacheEntries(vectors, times, trace_ids))]
            else:
                names = np.array(namespaces, dtype=object)
                keeps = [
                    (ns, np.flatnonzero(ok & (names == ns))) for ns in dict.fromkeys(namespaces)
                ]
                parts = [
                    (ns, CacheEntries(vectors[at], times[at], [trace_ids[i] for i in at]))
                    for ns, at in keeps
                    if len(at)
                ]
            for namespace, entries in parts:
                self._rows[namespace] = self._rows.get(namespace, 0) + len(entries.vectors)
                load(namespace, entries)
        if bad:
            self.status.checksum_failures_total += len(bad)
            warning = (
                f"cache database: {len(bad)} entries failed their checksum at start and were "
                "dropped (never served)"
            )
            self._start_warnings.append(warning)
            log.error(warning, extra={"path": str(self.path), "dropped": len(bad)})
        return bad

    def _checked_batch(self, batch: list[Any]) -> tuple[Any, ...] | None:
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
        return ok, vectors, times, ids, namespaces, list(trace_ids)

    def _recover(self, why: str) -> None:
        """Copies the damaged file aside byte for byte, keeps what can be read of it row by
        row in a new database, and says how many (log, health until the next start)."""
        path = self.path
        aside = path.with_name(f"{path.name}.damaged-{int(time.time())}")
        shutil.copyfile(path, aside)
        for suffix in ("-wal", "-shm"):
            extra = Path(f"{path}{suffix}")
            if extra.exists():
                shutil.copyfile(extra, Path(f"{aside}{suffix}"))
        rows = list(readable_rows(path))  # the files at the path go next (_build)
        memory = self._memory
        assert memory is not None
        kept_chunks: list[tuple[str, CacheEntries]] = []

        def keep(namespace: str, entries: CacheEntries) -> None:
            kept_chunks.append((namespace, entries))
            memory.load(namespace, entries)

        self._dispatch([rows[i : i + CHUNK] for i in range(0, len(rows), CHUNK)], keep)
        kept = sum(self._build(path, kept_chunks).values())
        self._conn = self._connect(path)
        detail = (
            f"the database was damaged ({why}); copied to {aside.name}; "
            f"{kept} entries kept of {len(rows)} readable rows"
        )
        self.status.state, self.status.detail = StorageState.RECOVERED, detail
        self.status.loaded_vectors = kept
        self._start_warnings.append(f"cache database recovered at start: {detail}")
        log.error(
            "cache database damaged: what could be read was kept",
            extra={"path": str(path), "aside": str(aside), "kept": kept, "reason": why},
        )

    def _convert(self) -> None:
        """The former snapshot and journal, read once into a new database; the former files
        kept beside it (`<name>.old-format`)."""
        path = self.path
        aside = path.with_name(f"{path.name}.old-format")
        try:
            e, dropped = read_former(path, self.model_id, self.dimensions)
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
        ids = e.ids()
        self._build(
            building,
            (
                ("default", CacheEntries(e.vectors[at], e.added_at_ms[at], ids[at]))
                for at in (slice(i, i + CHUNK) for i in range(0, len(e.vectors), CHUNK))
            ),
        )
        shutil.copyfile(path, aside)  # beside it before the database takes its name
        fsync(aside)
        move_database(building, path)
        for _, journal in journal_files(path):
            os.replace(journal, journal.with_name(f"{journal.name}.old-format"))
        self._open()  # the new database, loaded as any
        self.status.state = StorageState.CONVERTED
        self.status.detail = (
            f"converted from the former snapshot and journal ({len(e.vectors)} entries, "
            f"{dropped} journal records cut short); kept as {aside.name}"
        )
        log.warning(
            "cache snapshot converted to the database",
            extra={"path": str(path), "entries": self.status.loaded_vectors, "former": str(aside)},
        )

    def _build(
        self,
        at: Path,
        chunks: Iterable[tuple[str, CacheEntries]],
        rows: Sequence[NewRow] = (),
        receipts: Sequence[tuple[str, str]] = (),
    ) -> dict[str, int]:
        """A new database at `at` holding `chunks` then `rows` (and `receipts`), committed and
        closed with its WAL folded in; how many entries of each namespace it holds."""
        remove_database(at)
        counts: dict[str, int] = {}
        conn = self._connect(at, meta=True)
        try:
            conn.execute("BEGIN IMMEDIATE")
            for namespace, chunk in chunks:
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
        finally:
            close_quietly(conn)  # the last connection: its WAL folded in and deleted
        return counts

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
        forget: Collection[str] = (),
        checkpoint: bool = True,
        trim_from: int = 1,
        receipts: Sequence[tuple[str, str]] = (),
    ) -> None:
        """One transaction, committed (StorageError, nothing changed, when it cannot be): every
        row of each of `forget` (namespaces cleared, or let go by the memory) deleted; for each
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
        now = time.monotonic()
        if self._displaced is not None or now >= self._next_lock_check:
            self._next_lock_check = now + CHECK_INTERVAL_S
            if self._displaced is not None or not self._lock.intact():
                self._lock_again()
        gone = set(forget)
        if self._rewrite_due:
            self._rewrite(rows, gone, receipts)
        else:
            trims = {}
            for ns, kept in (held or {}).items():
                excess = self._rows.get(ns, 0) - kept
                if ns not in gone and excess >= max(1, trim_from):
                    trims[ns] = excess
            try:
                conn.execute("BEGIN IMMEDIATE")
                for namespace, excess in trims.items():
                    conn.execute(TRIM, (namespace, excess))
                for namespace in gone:
                    conn.execute("DELETE FROM entries WHERE namespace = ?", (namespace,))
                conn.executemany(INSERT, values(rows))
                if receipts:
                    at_ms = time.time() * 1000.0
                    conn.execute("DELETE FROM receipts WHERE at_ms < ?", (at_ms - RECEIPT_TTL_MS,))
                    conn.executemany(
                        "INSERT OR REPLACE INTO receipts VALUES (?, ?, ?)",
                        [(key, at_ms, text) for key, text in receipts],
                    )
                conn.execute("COMMIT")
            except (sqlite3.Error, OSError) as exc:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
                self._failed(reason(exc))
            # The kernel's word (one poll), the paths compared when it has some or is missing.
            watch = self._watch
            unchanged = watch is not None and not watch.ready.poll(0)
            if not (unchanged and now < self._next_path_check) and not self._files_intact():
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
        if checkpoint and self._pages_since_checkpoint >= CHECKPOINT_PAGES:
            self.checkpoint()

    def _lock_again(self) -> None:
        """The lock file deleted or replaced (another process could then take a new one):
        locked again; when another process holds it now, this one stores nothing until it
        can lock it again (StorageError naming the other)."""
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
        memory = self._memory
        assert memory is not None
        path = self.path
        building = path.with_name(f"{path.name}.rewriting")
        aside: str | None = None
        try:
            held = ((ns, chunk) for ns, chunk in memory.held() if ns not in gone)
            counts = self._build(building, held, rows, receipts)
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
            self._not_opened(reason(exc))
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
            self._watch.inotify.close()
            self._watch = None
        close_quietly(self._conn)
        self._conn = None
        self._lock.release()

    def health(self) -> Health:
        """Warnings, never degraded: novelty is measured whatever the file does."""
        warnings = [*self._start_warnings, *self._events]
        if self._conn is None and not self._closed and self._unopened is not None:
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
