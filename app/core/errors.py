"""The error body every 4xx about a request's content has: FastAPI's validation shape,
`{"detail": [{"loc": [...], "msg": ..., "type": ...}]}`. One builder, for the middleware's
limits, the trace limits and pydantic's own errors alike."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

Loc = Sequence[str | int]


def field_error(loc: Loc, msg: str, kind: str) -> dict[str, Any]:
    """One entry: where (`loc`), what rule (`msg`), and its machine-readable `type`."""
    return {"loc": list(loc), "msg": msg, "type": kind}


def error_body(errors: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The body around entries; each is re-built, so that nothing else they carry (pydantic
    echoes the offending input, which may be a trace's text) reaches the answer."""
    return {"detail": [field_error(e["loc"], e["msg"], e["type"]) for e in errors]}
