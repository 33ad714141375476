"""GET /cache/export and POST /cache/import: the memory as NDJSON lines, oldest first (the line
and its rules: docs/operating/persistence.md). Both go a chunk at a time, so a million entries
are never one document; an import is all or nothing, its first bad line named by number.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import AsyncIterator, Iterable

import numpy as np
import orjson

from app.core.errors import Problem, ServiceError
from app.memory.ring import CacheEntries
from app.schemas.ids import trace_id_problem

_WIRE = np.dtype("<f4")
#: A vector whose length is this close to 1 is already a unit vector (float32 rounding).
_UNIT_TOLERANCE = 1e-5


class ImportLineError(ServiceError):
    """A line that is not an entry; nothing of the request is imported."""

    def __init__(self, line: int, problem: str) -> None:
        msg = f"line {line}: {problem}"
        where = Problem(("body", line), msg, "bad_line", {"line": line})
        super().__init__(422, "bad_line", msg, problems=[where])


def export_lines(chunks: Iterable[CacheEntries]) -> Iterable[bytes]:
    """NDJSON, a chunk of lines at a time."""
    for chunk in chunks:
        vectors = np.ascontiguousarray(chunk.vectors, dtype=_WIRE)
        lines = [
            orjson.dumps(
                {
                    "trace_id": trace_id,
                    "added_at_ms": float(added_at),
                    "vector": base64.b64encode(vector.tobytes()).decode("ascii"),
                }
            )
            for trace_id, added_at, vector in zip(
                chunk.ids(), chunk.added_at_ms, vectors, strict=True
            )
        ]
        if lines:
            yield b"\n".join(lines) + b"\n"


class LineReader:
    """Parses an NDJSON body as it arrives; `finish()` once it has all been fed."""

    def __init__(self, dimensions: int) -> None:
        self.dimensions = dimensions
        self._rest = b""
        #: Lines read so far (1-based numbers in the refusals).
        self.lines = 0
        self._vectors: list[np.ndarray] = []
        self._times: list[float] = []
        self._ids: list[str] = []

    def feed(self, data: bytes) -> None:
        data = self._rest + data
        *complete, self._rest = data.split(b"\n")
        for raw in complete:
            self._parse(raw)

    def finish(self) -> CacheEntries:
        if self._rest.strip():
            self._parse(self._rest)
        self._rest = b""
        vectors = (
            np.stack(self._vectors)
            if self._vectors
            else np.empty((0, self.dimensions), dtype=np.float32)
        )
        return CacheEntries(vectors, np.asarray(self._times, dtype=np.float64), self._ids)

    def _parse(self, raw: bytes) -> None:
        self.lines += 1
        if not raw.strip():
            return  # blank lines (a trailing newline, CRLF leftovers) carry nothing
        try:
            item = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ImportLineError(self.lines, f"not JSON: {exc}") from None
        if not isinstance(item, dict):
            raise ImportLineError(self.lines, "must be a JSON object")
        missing = {"trace_id", "added_at_ms", "vector"} - item.keys()
        if missing:
            raise ImportLineError(self.lines, f"missing {', '.join(sorted(missing))}")
        trace_id, added_at, encoded = item["trace_id"], item["added_at_ms"], item["vector"]
        if not isinstance(trace_id, str):
            raise ImportLineError(self.lines, "trace_id must be a string")
        problem = trace_id_problem(trace_id)
        if problem is not None:
            raise ImportLineError(self.lines, f"trace_id {problem}")
        if (
            isinstance(added_at, bool)
            or not isinstance(added_at, int | float)
            or not math.isfinite(added_at)
            or added_at < 0
        ):
            raise ImportLineError(self.lines, "added_at_ms must be a finite number >= 0")
        if not isinstance(encoded, str):
            raise ImportLineError(self.lines, "vector must be a base64 string")
        try:
            data = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise ImportLineError(self.lines, "vector is not valid base64") from None
        if len(data) != self.dimensions * _WIRE.itemsize:
            raise ImportLineError(
                self.lines,
                f"vector holds {len(data)} bytes, not {self.dimensions} float32 "
                f"({self.dimensions * _WIRE.itemsize} bytes)",
            )
        wide = np.frombuffer(data, dtype=_WIRE).astype(np.float64)
        if not np.isfinite(wide).all():
            raise ImportLineError(self.lines, "vector must be finite (it has NaN or infinity)")
        norm = float(np.sqrt((wide * wide).sum()))
        if norm == 0.0:
            raise ImportLineError(self.lines, "vector must not be zero (it has no direction)")
        # The memory holds unit vectors, as the model makes them: a vector of another length
        # would weigh more (or less) than the traces it is compared with. One the model made
        # (unit to float32's precision) is kept bit for bit, so export then import is exact.
        if abs(norm - 1.0) > _UNIT_TOLERANCE:
            wide /= norm
        self._vectors.append(wide.astype(np.float32))
        self._times.append(float(added_at))
        self._ids.append(trace_id)


async def read_body(
    stream: AsyncIterator[bytes], dimensions: int, max_bytes: int
) -> tuple[CacheEntries, int]:
    """Every entry of an NDJSON body and the lines read; ImportLineError on the first bad
    line, a 413 past `max_bytes`."""
    reader = LineReader(dimensions)
    size = 0
    async for chunk in stream:
        size += len(chunk)
        if size > max_bytes:
            msg = (
                f"the import is larger than {max_bytes} bytes (KP_CACHE_IMPORT_MAX_BYTES): "
                "send the lines in several requests"
            )
            raise ServiceError(413, "body_too_large", msg, loc=("body",))
        reader.feed(chunk)
    return reader.finish(), reader.lines
