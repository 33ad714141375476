"""The one rule for trace ids, wherever one comes in (POST /evaluate, the batch, the MCP tools,
POST /cache/import), and the one way an id is shown as text.

An id is stored and later shown to other callers (`novelty.nearest.trace_id`, the MCP tool's
text, a terminal), so it holds nothing that acts instead of being read: printable characters
only (`str.isprintable`: no control, format, bidirectional, separator, private-use, surrogate
or unassigned code points; the space is allowed). The length bound is fixed, not a setting, so
that every instance can import what any other exported.
"""

from __future__ import annotations

from typing import Annotated, Final

from pydantic import AfterValidator, Field
from pydantic_core import PydanticCustomError

#: The longest trace id accepted, in characters (Unicode code points).
MAX_TRACE_ID_CHARS: Final = 256
#: Every trace id starts so (the ReasoningTrace schema).
TRACE_ID_PREFIX: Final = "kp:trace:"

RULE: Final = (
    f"must be at most {MAX_TRACE_ID_CHARS} printable characters "
    "(no control, format, bidirectional or separator characters other than the space)"
)


def trace_id_problem(value: str) -> str | None:
    """Why `value` is not an acceptable trace id (the rule and the first offending
    character, escaped), or None when it is one."""
    if len(value) > MAX_TRACE_ID_CHARS:
        return f"{RULE}: it has {len(value)} characters"
    if not value.isprintable():
        at, bad = next((i, c) for i, c in enumerate(value) if not c.isprintable())
        return f"{RULE}: character {at} is {_escape(bad)}"
    return None


def _check(value: str) -> str:
    if not value.isprintable():  # the length: the Field's max_length, checked before
        raise PydanticCustomError("trace_id_rule", trace_id_problem(value) or RULE)
    return value


#: The rule as the published schema can state it (docs/decisions/published-schema.md): no
#: control, format, private-use or separator character of the BMP but the space (Unicode 14);
#: the validator holds the whole rule.
ID_PATTERN: Final = (
    r"^kp:trace:[^\u0000-\u001f\u007f-\u00a0\u00ad\u0600-\u0605\u061c\u06dd\u070f"
    r"\u0890-\u0891\u08e2\u1680\u180e\u2000-\u200f\u2028-\u202f\u205f-\u2064"
    r"\u2066-\u206f\u3000\ue000-\uf8ff\ufeff\ufff9-\ufffb]{0,247}$"
)

#: The `id` of a ReasoningTrace: the prefix, then the rule above.
TraceId = Annotated[
    str,
    Field(
        pattern=r"^kp:trace:",
        max_length=MAX_TRACE_ID_CHARS,
        json_schema_extra={"pattern": ID_PATTERN},
    ),
    AfterValidator(_check),
]


def _escape(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def visible(text: str) -> str:
    """`text` with every unprintable character (and the backslash, so that an escape cannot
    be forged) written as a visible escape: safe in a terminal or a model's prompt, whatever
    was stored before the rule."""
    if text.isprintable() and "\\" not in text:
        return text
    return "".join("\\\\" if c == "\\" else c if c.isprintable() else _escape(c) for c in text)
