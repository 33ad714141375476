"""Size limits a trace must respect beyond its schema (KP_MAX_STEPS, KP_MAX_STRING_CHARS,
KP_MAX_JSON_DEPTH): each answers 422 naming the field and the limit."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from app.schemas.trace import ReasoningTrace

Loc = tuple[str | int, ...]

# A JSON string token, or a bracket outside strings.
_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)


@dataclass(frozen=True, slots=True)
class TraceLimits:
    max_batch: int
    max_steps: int
    max_string_chars: int


def json_depth_exceeds(body: bytes, limit: int) -> bool:
    """Whether arrays and objects nest deeper than `limit`, found without parsing the body."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    depth = 0
    for token in _JSON_TOKEN.finditer(body):
        char = token.group()[0]
        if char in b"[{":
            depth += 1
            if depth > limit:
                return True
        elif char in b"]}":
            depth -= 1
    return False


def limit_errors(
    traces: Sequence[ReasoningTrace], limits: TraceLimits, *, batch: bool
) -> list[dict[str, Any]]:
    """Validation errors in FastAPI's shape, one per field over a limit."""
    errors = []
    if batch and len(traces) > limits.max_batch:
        errors.append(
            _error(
                ("body", "traces"),
                f"at most {limits.max_batch} traces per batch (KP_MAX_BATCH), got {len(traces)}",
            )
        )
    for index, trace in enumerate(traces):
        loc: Loc = ("body", "traces", index) if batch else ("body",)
        if len(trace.steps) > limits.max_steps:
            errors.append(
                _error(
                    (*loc, "steps"),
                    f"at most {limits.max_steps} steps per trace (KP_MAX_STEPS), "
                    f"got {len(trace.steps)}",
                )
            )
        # No string is longer than its trace's JSON: walk the fields only when that is long.
        if len(trace.model_dump_json()) <= limits.max_string_chars:
            continue
        for path, text in _strings(trace, loc):
            if len(text) > limits.max_string_chars:
                errors.append(
                    _error(
                        path,
                        f"at most {limits.max_string_chars} characters per string "
                        f"(KP_MAX_STRING_CHARS), got {len(text)}",
                    )
                )
    return errors


def _error(loc: Loc, msg: str) -> dict[str, Any]:
    return {"loc": loc, "msg": msg, "type": "limit_exceeded"}


def _strings(value: Any, loc: Loc) -> Iterator[tuple[Loc, str]]:
    if isinstance(value, str):
        yield loc, value
    elif isinstance(value, BaseModel):
        for name, field in type(value).model_fields.items():
            yield from _strings(getattr(value, name), (*loc, field.alias or name))
    elif isinstance(value, dict):
        for key, item in value.items():
            yield (*loc, key), key
            yield from _strings(item, (*loc, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _strings(item, (*loc, i))
