"""JSON as JavaScript writes and reads it (`JSON.stringify`, `JSON.parse`), for values parsed
from JSON: what the SDK's capture step does to a step's `input` (app/contribution/capture.py).

What differs from Python's `json`: numbers are doubles written as `Number.prototype.toString`
writes them (`1e-7`, `100000000000000000000`, `1e+21`; `-0` as `0`; integers past 2**53
rounded; an integer past the largest double, 309 digits or more, read as Infinity and so
written `null`); an object's integer-like keys ("0", "42", up to 2**32 - 2) come first,
ascending, as JavaScript orders an object's properties; a lone surrogate is written as its
`\\u` escape; `NaN` and `Infinity` are not JSON.
"""

from __future__ import annotations

import json
import math
import re
from json.encoder import encode_basestring  # the C encoder, non-ASCII kept (as JavaScript)
from typing import Any

_MAX_SAFE = 2**53
_ARRAY_INDEX = re.compile(r"0|[1-9][0-9]{0,9}")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _array_index(key: str) -> bool:
    return _ARRAY_INDEX.fullmatch(key) is not None and int(key) < 2**32 - 1


def js_keys(obj: dict[str, Any]) -> list[str]:
    """The keys in JavaScript's property order."""
    indices = [k for k in obj if _array_index(k)]
    if not indices:
        return list(obj)
    indices.sort(key=int)
    return indices + [k for k in obj if not _array_index(k)]


def js_number_text(value: float) -> str:
    """`String(value)` for a double (`null` for a non-finite one, as JSON.stringify)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) <= _MAX_SAFE:
        return str(value)
    x = float(js_value(value))
    if not math.isfinite(x):
        return "null"
    if x == 0:
        return "0"
    text = repr(x)
    sign = "-" if text.startswith("-") else ""
    mantissa, _, exponent = text.lstrip("-").partition("e")
    whole, _, fraction = mantissa.partition(".")
    all_digits = whole + fraction
    significant = all_digits.lstrip("0")
    # n: where the decimal point falls after the first significant digit (ECMA-262's n).
    n = len(whole) + (int(exponent) if exponent else 0) - (len(all_digits) - len(significant))
    digits = significant.rstrip("0")
    k = len(digits)
    if k <= n <= 21:
        body = digits + "0" * (n - k)
    elif 0 < n <= 21:
        body = f"{digits[:n]}.{digits[n:]}"
    elif -6 < n <= 0:
        body = "0." + "0" * -n + digits
    else:
        e = n - 1
        head = digits if k == 1 else f"{digits[0]}.{digits[1:]}"
        body = f"{head}e{'+' if e >= 0 else '-'}{abs(e)}"
    return sign + body


def _string_text(value: str) -> str:
    text: str = encode_basestring(value)
    if _LONE_SURROGATE.search(text):
        # JSON.stringify escapes a lone surrogate; a pair is one character here already.
        text = _LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
    return text


def stringify(value: Any) -> str:
    """`JSON.stringify(value)` (no spaces)."""
    if isinstance(value, str):
        return _string_text(value)
    if value is None or isinstance(value, bool):
        return "null" if value is None else "true" if value else "false"
    if isinstance(value, int | float):
        return js_number_text(value)
    if isinstance(value, dict):
        members = (f"{_string_text(key)}:{stringify(value[key])}" for key in js_keys(value))
        return "{" + ",".join(members) + "}"
    if isinstance(value, list):
        return "[" + ",".join(map(stringify, value)) + "]"
    raise TypeError(f"not a JSON value: {type(value).__name__}")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _number(text: str) -> float | int:
    number: float | int = js_value(float(text) if any(c in text for c in ".eE") else int(text))
    return number


def parse(text: str) -> Any:
    """`JSON.parse(text)`, numbers as JavaScript holds them (see `js_value`); ValueError for
    text that JSON.parse refuses."""
    return json.loads(text, parse_constant=_no_constant, parse_int=_number, parse_float=_number)


def js_value(value: Any) -> Any:
    """A number as the double JavaScript holds: an integral one within 2**53 as an int (so
    that it is written `1`, not `1.0`), `-0` as 0, any other as a float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value
    if isinstance(value, int):
        if abs(value) <= _MAX_SAFE:
            return value
        try:
            return float(value)
        except OverflowError:  # past the largest double: JavaScript reads Infinity
            return math.inf if value > 0 else -math.inf
    if value.is_integer() and abs(value) <= _MAX_SAFE:  # False for inf and nan
        return int(value)
    return value


def as_sent(value: Any) -> Any:
    """`JSON.parse(JSON.stringify(value))` without the text: JavaScript's key order and
    numbers, throughout."""
    if isinstance(value, dict):
        return {k: as_sent(value[k]) for k in js_keys(value)}
    if isinstance(value, list):
        return [as_sent(v) for v in value]
    value = js_value(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON.stringify writes a non-finite number as null
    return value
