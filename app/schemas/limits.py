"""Size limits a trace must respect beyond its schema (KP_MAX_STEPS, KP_MAX_STRING_CHARS,
KP_MAX_JSON_DEPTH): each answers 422 naming the field and the limit."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
from pydantic import BaseModel

from app.core.errors import field_error
from app.schemas.trace import ReasoningTrace

Loc = tuple[str | int, ...]

_NOT_BRACKETS: Final = bytes(sorted(set(range(256)) - set(b"[]{}")))


@dataclass(frozen=True, slots=True)
class TraceLimits:
    max_batch: int
    max_steps: int
    max_string_chars: int


def json_depth_exceeds(body: bytes, limit: int) -> bool:
    """Whether arrays and objects nest deeper than `limit`, found without parsing the body.

    Brackets inside strings do not count. The strings' contents are dropped in bulk (escaped
    backslashes and quotes first, then every other run between quotes) and the depth is a
    cumulative sum, so that no Python code runs per character of a megabyte body. Up to the
    first error in a malformed body the quotes pair as the parser pairs them, and it nests no
    deeper than that.
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    unescaped = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside_strings = b"".join(unescaped.split(b'"')[::2])
    brackets = np.frombuffer(outside_strings.translate(None, _NOT_BRACKETS), dtype=np.uint8)
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1)
    return bool(steps.cumsum().max(initial=0) > limit)


def limit_errors(
    traces: Sequence[ReasoningTrace],
    limits: TraceLimits,
    *,
    batch: bool,
    body_bytes: int | None = None,
) -> list[dict[str, Any]]:
    """Validation errors in FastAPI's shape, one per field over a limit. `body_bytes`: the
    JSON body's size, when known: every character of a string takes at least one byte of it,
    so a body no larger than the string limit needs no walk through its strings."""
    errors = []
    strings_fit = body_bytes is not None and body_bytes <= limits.max_string_chars
    if batch and len(traces) > limits.max_batch:
        errors.append(
            _over_limit(
                ("body", "traces"),
                f"at most {limits.max_batch} traces per batch (KP_MAX_BATCH), got {len(traces)}",
            )
        )
    for index, trace in enumerate(traces):
        loc: Loc = ("body", "traces", index) if batch else ("body",)
        if len(trace.steps) > limits.max_steps:
            errors.append(
                _over_limit(
                    (*loc, "steps"),
                    f"at most {limits.max_steps} steps per trace (KP_MAX_STEPS), "
                    f"got {len(trace.steps)}",
                )
            )
        # Fields are named (a slower walk) only when some string is over the limit.
        if strings_fit or _longest_string(trace) <= limits.max_string_chars:
            continue
        for path, text in _strings(trace, loc):
            if len(text) > limits.max_string_chars:
                errors.append(
                    _over_limit(
                        path,
                        f"at most {limits.max_string_chars} characters per string "
                        f"(KP_MAX_STRING_CHARS), got {len(text)}",
                    )
                )
    return errors


def sent_string_errors(
    sent: Any, max_string_chars: int, *, at: Loc = ("body",), body_bytes: int | None = None
) -> list[dict[str, Any]]:
    """KP_MAX_STRING_CHARS over the JSON as sent (parsed, not validated): a string or key
    in a field the schema does not name (which validation drops) obeys it as a named one does.
    An error naming each field over the limit (`at` first); none when `body_bytes`, the
    body's size, is within the limit (every character takes a byte of it)."""
    if body_bytes is not None and body_bytes <= max_string_chars:
        return []
    if _longest_string(sent) <= max_string_chars:
        return []
    return [
        _over_limit(
            path,
            f"at most {max_string_chars} characters per string (KP_MAX_STRING_CHARS), "
            f"got {len(text)}",
        )
        for path, text in _strings(sent, at)
        if len(text) > max_string_chars
    ]


def _longest_string(value: Any) -> int:
    """Length of the longest string (dictionary keys included) in a model's values."""
    longest, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            longest = max(longest, len(item))
        elif isinstance(item, BaseModel):
            stack.extend(item.__dict__.values())
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return longest


def _over_limit(loc: Loc, msg: str) -> dict[str, Any]:
    return field_error(loc, msg, "limit_exceeded")


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
