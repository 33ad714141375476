"""Reads the files of the former persistence (a snapshot, `KPCACHE1`, formats 1 and 2, and its
journal generations, `<snapshot>.journal.<generation>`, `KPJRNL01`) once, to convert them into
the database at start (app/memory/sqlite.py). Read only; removed with the deprecated
settings in the next release.

A snapshot: magic, 4-byte little-endian header length, JSON header (model, dimensions, count,
trace_ids_bytes, payload_sha256, journal_generation), then `count x dimensions` float32
vectors, `count` float64 times and the trace ids as a JSON array. A journal file: magic, a
4-byte length and a JSON header (model, dimensions), then records of a 4-byte length, a 4-byte
CRC-32 and a payload: `A` (count, ids length, times, vectors, ids) or `C` (a clear). A record
cut short or failing its CRC ends its file, as it did then.
"""

from __future__ import annotations

import hashlib
import re
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson

from app.core.errors import PartError
from app.memory.ring import CacheEntries

SNAPSHOT_MAGIC = b"KPCACHE1"
JOURNAL_MAGIC = b"KPJRNL01"
_LENGTH = struct.Struct("<I")
_RECORD = struct.Struct("<II")
_ADD_HEAD = struct.Struct("<cII")


class FormerFilesError(PartError):
    """The former files cannot be converted (damaged, or of another model)."""


def is_former_snapshot(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(len(SNAPSHOT_MAGIC)) == SNAPSHOT_MAGIC
    except OSError:
        return False


def journal_files(path: Path) -> list[tuple[int, Path]]:
    pattern = re.compile(re.escape(path.name) + r"\.journal\.(\d{6})$")
    found = [(pattern.match(p.name), p) for p in path.parent.glob(f"{path.name}.journal.*")]
    return sorted((int(m.group(1)), p) for m, p in found if m)


def _header(data: bytes, magic: bytes, name: str) -> tuple[dict[str, object], int]:
    if not data.startswith(magic) or len(data) < len(magic) + _LENGTH.size:
        raise FormerFilesError(f"{name}: not a file of the former format")
    (length,) = _LENGTH.unpack_from(data, len(magic))
    start = len(magic) + _LENGTH.size
    try:
        header = orjson.loads(data[start : start + length])
    except orjson.JSONDecodeError as exc:
        raise FormerFilesError(f"{name}: unreadable header: {exc}") from None
    if not isinstance(header, dict):
        raise FormerFilesError(f"{name}: unreadable header")
    return header, start + length


def _same_model(header: dict[str, object], name: str, model_id: str, dimensions: int) -> None:
    if header.get("model") != model_id or header.get("dimensions") != dimensions:
        raise FormerFilesError(
            f"{name} is from model {header.get('model')} ({header.get('dimensions')} "
            f"dimensions); this service runs {model_id} ({dimensions} dimensions)"
        )


def read_former(path: Path, model_id: str, dimensions: int) -> tuple[CacheEntries, int]:
    """The snapshot at `path` and the journal generations it does not hold, replayed: what the
    former files held, oldest first, and how many journal records were cut short or failed
    their CRC."""
    data = path.read_bytes()
    header, end = _header(data, SNAPSHOT_MAGIC, path.name)
    _same_model(header, path.name, model_id, dimensions)
    try:
        count = int(str(header["count"]))
        ids_len = int(str(header.get("trace_ids_bytes", 0)))
        checksum = str(header["payload_sha256"])
        generation = int(str(header.get("journal_generation", 0)))
    except (KeyError, ValueError) as exc:
        raise FormerFilesError(f"{path.name}: unreadable header: {exc}") from None
    payload = memoryview(data)[end:]
    if len(payload) != count * dimensions * 4 + count * 8 + ids_len:
        raise FormerFilesError(f"{path.name}: payload truncated or too long")
    if hashlib.sha256(payload).hexdigest() != checksum:
        raise FormerFilesError(f"{path.name}: checksum does not match its payload")
    vectors = np.frombuffer(payload, "<f4", count * dimensions).reshape(count, dimensions)
    times = np.frombuffer(payload, "<f8", count, count * dimensions * 4)
    ids = orjson.loads(payload[count * dimensions * 4 + count * 8 :]) if ids_len else [""] * count
    parts = [(vectors, times, list(ids))]
    dropped = 0
    for number, journal in journal_files(path):
        if number < generation:
            continue  # held by the snapshot
        for change in _changes(journal, model_id, dimensions):
            if change is None:
                dropped += 1
            elif isinstance(change, str):
                parts.clear()  # a clear: nothing before it stays
            else:
                parts.append(change)
    if not parts:
        return CacheEntries(np.empty((0, dimensions), np.float32), np.empty(0), []), dropped
    return CacheEntries(
        np.concatenate([p[0] for p in parts]).astype(np.float32),
        np.concatenate([p[1] for p in parts]).astype(np.float64),
        [trace_id for p in parts for trace_id in p[2]],
    ), dropped


Part = tuple[np.ndarray, np.ndarray, list[str]]


def _changes(path: Path, model_id: str, dimensions: int) -> Iterator[Part | str | None]:
    """Each record's entries, "clear" for a clear, None for a dropped tail."""
    data = path.read_bytes()
    if len(data) < len(JOURNAL_MAGIC) + _LENGTH.size:
        return  # cut before its header was whole: empty
    header, end = _header(data, JOURNAL_MAGIC, path.name)
    _same_model(header, path.name, model_id, dimensions)
    while end + _RECORD.size <= len(data):
        length, crc = _RECORD.unpack_from(data, end)
        start, stop = end + _RECORD.size, end + _RECORD.size + length
        if stop > len(data) or zlib.crc32(data[start:stop]) != crc:
            yield None
            return
        record = memoryview(data)[start:stop]
        if bytes(record[:1]) == b"C":
            yield "clear"
        elif bytes(record[:1]) == b"A" and len(record) >= _ADD_HEAD.size:
            _, count, ids_len = _ADD_HEAD.unpack_from(record)
            at = _ADD_HEAD.size
            times = np.frombuffer(record, "<f8", count, at)
            at += count * 8
            vectors = np.frombuffer(record, "<f4", count * dimensions, at)
            at += count * dimensions * 4
            ids = orjson.loads(record[at : at + ids_len])
            yield vectors.reshape(count, dimensions), times, list(ids)
        else:
            yield None
            return
        end = stop
    if end < len(data):
        yield None
