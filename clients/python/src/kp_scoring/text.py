"""Text from the service (and from files) made safe to print on a terminal or hand to a model.

A trace id, a stored trace's id (`novelty.nearest.trace_id`) or an error message is data that
another agent may have chosen: printed raw, an escape sequence in it can clear or rewrite the
reader's terminal, a newline can forge a line of output, and a bidirectional override can
make text read differently from what it is. `visible` writes each such character as a visible
escape (`\\x1b`, `\\n`, `\\u202e`), the way Python's `repr` does, and leaves all other text,
non-ASCII letters and emoji included, as it is.
"""

from __future__ import annotations

import re

__all__ = ["visible"]

# C0 controls, DEL and C1 controls; the bidirectional marks, embeddings, overrides and
# isolates; the line and paragraph separators; lone surrogates (unprintable).
_SUSPECT = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    if char in _SHORT:
        return _SHORT[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(text: object) -> str:
    """`text` (any object: its str) with control characters (C0, DEL, C1), line and paragraph
    separators, bidirectional controls and lone surrogates written as visible escapes."""
    return _SUSPECT.sub(_escape, str(text))
