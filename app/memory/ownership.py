"""Who may open the in-process memory's database (docs/operating/persistence.md): one process
at a time, holding an exclusive flock on `<database>.lock` (with its PID, host and start time,
for the message a second one gets; the kernel lets go however the process ends), and only a
release that knows its schema. Light on purpose: app/serve.py asks `refusal` before the server
starts, to refuse with one line.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sqlite3
import time
from pathlib import Path
from urllib.parse import quote

from app.core.errors import PartError

#: The database's format: a release refuses a database whose `schema` is larger.
SCHEMA_VERSION = 2
SQLITE_HEADER = b"SQLite format 3\x00"


class DatabaseRefusedError(PartError):
    """This process may not use the database: another process owns it, or a later release
    wrote it. Nothing was changed."""


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class OwnerLock:
    """The exclusive lock on `<database>.lock`, held from `acquire` to `release`."""

    def __init__(self, database: Path) -> None:
        self.database = database
        self.path = database.with_name(f"{database.name}.lock")
        self._path_text = str(self.path)
        self._fd: int | None = None
        self._identity: tuple[int, int] | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Takes the lock (a no-op when held). DatabaseRefusedError naming the owner when
        another process holds it; OSError when the lock file cannot be made (no directory,
        no permission): the caller treats that as a database that cannot be opened."""
        if self._fd is not None:
            return
        fd = os.open(self._path_text, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            owner = "another process"
            with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
                found = json.loads(self.path.read_text(encoding="utf-8"))
                owner = (
                    f"process {int(found['pid'])} on host {found['host']} (since {found['since']})"
                )
            raise DatabaseRefusedError(
                f"the database {self.database} is in use by {owner}, which holds {self.path.name}: "
                "one process owns a database; give this one its own KP_CACHE_DB_PATH, or stop "
                "the other first"
            ) from None
        self._fd = fd
        held = os.fstat(fd)
        self._identity = held.st_dev, held.st_ino
        # Who holds it, for the message a second process gets. A full disk may refuse these
        # few bytes: the lock holds all the same.
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": utc_now()}
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder).encode() + b"\n", 0)

    def intact(self) -> bool:
        """Whether the lock file at the path is still the one this process locked (not
        deleted or replaced: else a second process could lock a new one)."""
        try:
            found = os.stat(self._path_text)
        except OSError:
            return False
        return (found.st_dev, found.st_ino) == self._identity

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def newer_schema(database: Path) -> str | None:
    """Why a database written by a later release may not be opened (its `schema` is larger
    than SCHEMA_VERSION), or None. Read through a read-only connection: nothing of the file
    is changed. A file that is not a database, or not this service's, is left to the start
    (it is recovered or set aside)."""
    try:
        with database.open("rb") as f:
            if f.read(len(SQLITE_HEADER)) != SQLITE_HEADER:
                return None
    except OSError:
        return None
    # A read-only connection to a WAL database makes an empty -wal and an -shm where there
    # were none: they go again.
    made = [
        extra for extra in (Path(f"{database}-wal"), Path(f"{database}-shm")) if not extra.exists()
    ]
    try:
        conn = sqlite3.connect(f"file:{quote(str(database))}?mode=ro", uri=True)
    except sqlite3.Error:
        return None
    try:
        row = conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
    except sqlite3.Error:
        return None
    finally:
        conn.close()
        for extra in made:
            with contextlib.suppress(OSError):
                if extra.name.endswith("-shm") or not extra.stat().st_size:
                    extra.unlink()
    if row is None:
        return None
    try:
        schema = int(row[0])
    except (TypeError, ValueError):
        return f"the database {database} has schema {row[0]!r}, which this release cannot read"
    if schema <= SCHEMA_VERSION:
        return None
    return (
        f"the database {database} has schema {schema}, newer than this release's "
        f"{SCHEMA_VERSION} (a later release wrote it): run that release, or move the file "
        "away to start with an empty memory; it was left as it is"
    )


def refusal(database: Path) -> str | None:
    """Before the service starts: why it may not open `database` (another process owns it, or
    a later release wrote it), or None. The lock is let go again at once: the memory takes it
    when it opens the database."""
    lock = OwnerLock(database)
    try:
        lock.acquire()
    except DatabaseRefusedError as exc:
        return str(exc)
    except OSError:
        return None  # no directory, no permission: the start reports it (/readyz)
    lock.release()
    return newer_schema(database)
