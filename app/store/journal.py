"""The in-process memory's journal: every change appended to a file beside the snapshot before
it is answered, replayed at start after the snapshot, and dropped once a snapshot holds it
(docs/operating/persistence.md).

Files: `<snapshot>.journal.<generation>` (six digits). A snapshot save starts a new
generation at the moment its copy is fixed (`Journal.rotate`, under the same lock as the
changes), so the snapshot holds exactly what the older generations say, and says in its header
the first generation it does not hold; once it is safely written the older ones are deleted.
A start loads the snapshot, then replays the generations from that one on, in order.

A file: `MAGIC`, a 4-byte little-endian length and a JSON header (model, dimensions,
generation), then records: 4-byte length, 4-byte CRC-32 of the payload, the payload. An add
record (`A`) holds entries as the memory stored them (times, vectors, ids); a clear (`C`)
nothing. A record cut short by a crash (or failing its CRC) ends the replay of its file, and the
file is cut back to its last whole record before new ones are appended.

Durability (`fsync`): `always` flushes the file to disk before the answer; `everysec` writes
before the answer (a killed process loses nothing: the data is in the kernel) and flushes once
a second (a power loss costs at most about the last second). Imports and clears are flushed
before their answer under either policy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import orjson

from app.domain.vector_cache import CacheEntries

log = logging.getLogger(__name__)

FsyncPolicy = Literal["everysec", "always"]
MAGIC = b"KPJRNL01"
_LENGTH = struct.Struct("<I")
_RECORD = struct.Struct("<II")  # payload length, CRC-32
_ADD_HEAD = struct.Struct("<cII")  # b"A", count, ids bytes
_ADD, _CLEAR = b"A", b"C"
_MAX_HEADER = 64 * 1024


class JournalError(Exception):
    """A journal that cannot be replayed (another model's): set aside, not loaded."""


@dataclass(frozen=True, slots=True)
class Change:
    """One replayed change: `entries` added (as stored), or a clear (`entries` None)."""

    entries: CacheEntries | None


class Journal:
    """Appends changes; `lock` must be held across a change to the memory and its record, so
    that a rotation never falls between them."""

    def __init__(self, snapshot_path: Path, model_id: str, dimensions: int, fsync: FsyncPolicy):
        self.base = snapshot_path
        self.model_id = model_id
        self.dimensions = dimensions
        self.fsync = fsync
        self.lock = threading.RLock()
        self.generation = 0
        self._fd: int | None = None
        self._dirty = False  # written since the last fsync
        self.records_total = 0
        self.write_errors_total = 0
        self.last_error: str | None = None

    # ── files ───────────────────────────────────────────────────────────────

    def path(self, generation: int) -> Path:
        return self.base.with_name(f"{self.base.name}.journal.{generation:06d}")

    def generations(self) -> list[int]:
        pattern = re.compile(re.escape(self.base.name) + r"\.journal\.(\d{6})$")
        found = (
            pattern.match(p.name) for p in self.base.parent.glob(f"{self.base.name}.journal.*")
        )
        return sorted(int(m.group(1)) for m in found if m)

    # ── start ───────────────────────────────────────────────────────────────

    def replay(self, from_generation: int) -> Iterator[Change]:
        """The changes of every generation from `from_generation` on, oldest first (a torn
        tail cut off); older generations (held by the snapshot) are deleted. Then `open`."""
        for generation in self.generations():
            path = self.path(generation)
            if generation < from_generation:
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            self.generation = max(self.generation, generation)
            try:
                yield from self._read(path)
            except JournalError as exc:
                aside = path.with_name(f"{path.name}.other_model-{int(time.time())}")
                os.replace(path, aside)
                log.error("cache journal set aside", extra={"path": str(path), "reason": str(exc)})
        self.generation = max(self.generation, from_generation)

    def _read(self, path: Path) -> Iterator[Change]:
        data = path.read_bytes()
        end = self._header_end(data, path)
        if end is None:  # cut before its header was whole (a crash as it was made): empty
            with open(path, "r+b") as f:
                f.truncate(0)
            return
        good = end
        while end + _RECORD.size <= len(data):
            length, crc = _RECORD.unpack_from(data, end)
            start, stop = end + _RECORD.size, end + _RECORD.size + length
            if stop > len(data) or zlib.crc32(data[start:stop]) != crc:
                break
            change = self._decode(memoryview(data)[start:stop])
            if change is None:
                break
            yield change
            end = good = stop
        if good < len(data):
            log.warning(
                "cache journal: a record cut short by a crash was dropped",
                extra={"path": str(path), "bytes": len(data) - good},
            )
            with open(path, "r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())

    def _header_end(self, data: bytes, path: Path) -> int | None:
        if len(data) < len(MAGIC) + _LENGTH.size or not data.startswith(MAGIC):
            return None
        (length,) = _LENGTH.unpack_from(data, len(MAGIC))
        start = len(MAGIC) + _LENGTH.size
        if length > _MAX_HEADER or start + length > len(data):
            return None
        header = orjson.loads(data[start : start + length])
        if header.get("model") != self.model_id or header.get("dimensions") != self.dimensions:
            raise JournalError(
                f"{path.name} is from model {header.get('model')} "
                f"({header.get('dimensions')} dimensions)"
            )
        return int(start + length)

    def _decode(self, payload: memoryview) -> Change | None:
        kind = bytes(payload[:1])
        if kind == _CLEAR:
            return Change(None)
        if kind != _ADD or len(payload) < _ADD_HEAD.size:
            return None
        _, count, ids_len = _ADD_HEAD.unpack_from(payload)
        at = _ADD_HEAD.size
        times = np.frombuffer(payload, "<f8", count, at)
        at += count * 8
        vectors = np.frombuffer(payload, "<f4", count * self.dimensions, at)
        at += count * self.dimensions * 4
        ids = orjson.loads(payload[at : at + ids_len])
        entries = CacheEntries(
            vectors.reshape(count, self.dimensions).astype(np.float32),
            times.astype(np.float64),
            ids,
        )
        return Change(entries)

    def open(self) -> None:
        """Appends to the current generation from now on (created when missing)."""
        with self.lock:
            try:
                self._open(self.generation)
            except OSError as exc:
                # Serving goes on without it, and says so (health); a save tries again.
                self.write_errors_total += 1
                self.last_error = f"{exc.strerror or exc} ({self.path(self.generation)})"
                log.error("cache journal cannot be opened", extra={"error": self.last_error})

    def _open(self, generation: int) -> None:
        path = self.path(generation)
        fresh = not path.exists() or path.stat().st_size == 0
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self.last_error = None
        if fresh:
            header = orjson.dumps(
                {"model": self.model_id, "dimensions": self.dimensions, "generation": generation}
            )
            os.ftruncate(fd, 0)
            _write_all(fd, MAGIC + _LENGTH.pack(len(header)) + header)
            os.fsync(fd)
            fsync_directory(path.parent)
        self._fd, self.generation = fd, generation

    # ── changes ─────────────────────────────────────────────────────────────

    def record_adds(self, entries: CacheEntries) -> None:
        """Entries as the memory stored them (hold `lock` across the change and this)."""
        count = len(entries.vectors)
        if count == 0:
            return
        ids = orjson.dumps(list(entries.ids()))
        vectors = np.ascontiguousarray(entries.vectors, dtype="<f4")
        times = np.ascontiguousarray(entries.added_at_ms, dtype="<f8")
        self._append(
            [_ADD_HEAD.pack(_ADD, count, len(ids)), times.tobytes(), vectors.tobytes(), ids]
        )

    def record_clear(self) -> None:
        self._append([_CLEAR])

    def _append(self, parts: list[bytes]) -> None:
        payload = b"".join(parts)
        with self.lock:
            if self._fd is None:
                return
            try:
                _write_all(self._fd, _RECORD.pack(len(payload), zlib.crc32(payload)) + payload)
            except OSError as exc:
                # The memory changed already; serving goes on, and says so (health, metrics).
                self.write_errors_total += 1
                self.last_error = f"{exc.strerror or exc} ({self.path(self.generation)})"
                log.error("cache journal not written", extra={"error": self.last_error})
                return
            self._dirty = True
            self.records_total += 1

    def sync(self) -> None:
        """Flushes what was written to disk (a no-op when nothing was)."""
        with self.lock:
            if self._fd is None or not self._dirty:
                return
            # A copy of the descriptor: a rotation may close the original meanwhile, and
            # changes go on being written while this one waits for the disk.
            fd = os.dup(self._fd)
            self._dirty = False
        try:
            os.fsync(fd)
        except OSError as exc:
            self.write_errors_total += 1
            self.last_error = f"fsync: {exc.strerror or exc}"
            log.error("cache journal not flushed", extra={"error": self.last_error})
        finally:
            os.close(fd)

    # ── compaction ──────────────────────────────────────────────────────────

    def rotate(self) -> int:
        """Starts the next generation; returns it (hold `lock`, and fix the snapshot's copy
        before releasing it). The current one is flushed first."""
        with self.lock:
            if self._fd is not None:
                with contextlib.suppress(OSError):
                    os.fsync(self._fd)
                os.close(self._fd)
                self._fd = None
            self._dirty = False
            self._open(self.generation + 1)
            return self.generation

    def drop_before(self, generation: int) -> None:
        """Deletes the generations a snapshot now holds."""
        for older in self.generations():
            if older < generation:
                with contextlib.suppress(OSError):
                    self.path(older).unlink()

    def close(self) -> None:
        self.sync()
        with self.lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def fsync_directory(directory: Path) -> None:
    """Makes a rename or a new file in `directory` durable; not every filesystem lets a
    directory be opened."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
