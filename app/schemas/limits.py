"""Limits a trace must respect beyond its schema (KP_MAX_STEPS, KP_MAX_STRING_CHARS,
KP_MAX_JSON_DEPTH, JSON's own rules): each answers 422 naming the field and the limit."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any, Final

import numpy as np

from app.core.config import Settings
from app.core.errors import Problem

Loc = tuple[str | int, ...]

_NOT_BRACKETS: Final = bytes(sorted(set(range(256)) - set(b"[]{}")))


def json_problem(body: bytes, max_depth: int) -> tuple[str, str] | None:
    """(kind, why) a JSON body breaks a rule the parser would not state clearly, found before
    parsing: nesting deeper than `max_depth` or a number longer than Python reads (4,300
    digits), outside strings, with no Python code per character of the body
    (docs/decisions/cheap-body-checks.md)."""
    deep = body.count(b"[") + body.count(b"{") > max_depth
    long_number = _LONG_DIGITS.search(body) is not None
    if not (deep or long_number):
        return None
    unescaped = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside_strings = b"".join(unescaped.split(b'"')[::2])
    if deep:
        brackets = np.frombuffer(outside_strings.translate(None, _NOT_BRACKETS), dtype=np.uint8)
        steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1)
        if steps.cumsum().max(initial=0) > max_depth:
            why = f"JSON nests deeper than {max_depth} levels (KP_MAX_JSON_DEPTH)"
            return "limit_exceeded", why
    if long_number and _LONG_DIGITS.search(outside_strings) is not None:
        return "json_invalid", f"a number has more than {MAX_NUMBER_DIGITS} digits"
    return None


#: The longest run of digits a number may have (Python's int limit).
MAX_NUMBER_DIGITS: Final = 4300
_LONG_DIGITS: Final = re.compile(rb"[0-9]{%d}" % (MAX_NUMBER_DIGITS + 1))


def limit_problems(
    sent: Sequence[Any], limits: Settings, *, batch: bool, body_bytes: int | None = None
) -> list[Problem]:
    """One problem per field over a limit, in the traces as sent (parsed JSON, validated
    already): fields the schema does not name obey the string limit too. `body_bytes`: the
    JSON body's size, when known: every character of a string takes at least one byte of it,
    so a body no larger than the string limit needs no walk through its strings."""
    problems = []
    strings_fit = body_bytes is not None and body_bytes <= limits.max_string_chars
    if batch and len(sent) > limits.max_batch:
        msg = f"at most {limits.max_batch} traces per batch (KP_MAX_BATCH), got {len(sent)}"
        problems.append(Problem(("body", "traces"), msg, "limit_exceeded"))
    for index, trace in enumerate(sent):
        loc: Loc = ("body", "traces", index) if batch else ("body",)
        steps = len(trace["steps"])
        if steps > limits.max_steps:
            msg = f"at most {limits.max_steps} steps per trace (KP_MAX_STEPS), got {steps}"
            problems.append(Problem((*loc, "steps"), msg, "limit_exceeded"))
        # Fields are named (a slower walk) only when some string is over the limit.
        if strings_fit or _longest_string(trace) <= limits.max_string_chars:
            continue
        for path, text in _strings(trace, loc):
            if len(text) > limits.max_string_chars:
                msg = (
                    f"at most {limits.max_string_chars} characters per string "
                    f"(KP_MAX_STRING_CHARS), got {len(text)}"
                )
                problems.append(Problem(path, msg, "limit_exceeded"))
    return problems


def _longest_string(value: Any) -> int:
    """Length of the longest string (object keys included) in a JSON value."""
    longest, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            longest = max(longest, len(item))
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return longest


def lone_surrogate(value: Any) -> Loc | None:
    """Where the first string (or key: then its member) holding a lone surrogate is, which
    JSON can escape and JavaScript holds but UTF-8 cannot carry; None when none does."""
    for loc, text in _strings(value, ()):
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # a surrogate: the only str that UTF-8 cannot encode
                return loc
    return None


def _strings(value: Any, loc: Loc) -> Iterator[tuple[Loc, str]]:
    if isinstance(value, str):
        yield loc, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield (*loc, key), key
            yield from _strings(item, (*loc, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _strings(item, (*loc, i))
