"""JavaScript regular expressions (no `u` flag) as Python `re` patterns with the same matches.

A JavaScript pattern without the `u` flag reads UTF-16 code units; its `\\d`, `\\w` and `\\b`
are ASCII-only, its `\\s` is Unicode white space plus U+FEFF (but not U+001C-U+001F nor U+0085,
which Python's `\\s` takes) and its `/i` folds no letter outside ASCII onto an ASCII one (Python
folds ſ to s and the Kelvin sign to k): `compile_js` compiles with `re.ASCII` and spells `\\s`
out as JavaScript's set.
"""

from __future__ import annotations

import re

#: JavaScript's `\s`: WhiteSpace and LineTerminator (ECMA-262), as a character-class body.
JS_SPACE = "\\t\\n\\v\\f\\r \\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000\\ufeff"
#: The same without the line feed (a line-start rule's leading white space, app/domain/injection).
JS_SPACE_NO_LF = JS_SPACE.replace("\\n", "")

_ASTRAL = re.compile("[\U00010000-\U0010ffff]")


def translate(source: str) -> str:
    """The Python spelling of a JavaScript pattern's source: `\\s` and `\\S` spelled out, named
    groups and `\\k<name>` backreferences in Python's syntax, `\\/` as `/`."""
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(source):
        c = source[i]
        if c == "\\":
            nxt = source[i + 1]
            if nxt == "s":
                out.append(JS_SPACE if in_class else f"[{JS_SPACE}]")
            elif nxt == "S":
                if in_class:
                    raise ValueError("\\S inside a class has no Python spelling here")
                out.append(f"[^{JS_SPACE}]")
            elif nxt == "/":
                out.append("/")
            elif nxt == "k" and not in_class and source.startswith("<", i + 2):
                end = source.index(">", i)
                out.append(f"(?P={source[i + 3 : end]})")
                i = end + 1
                continue
            else:
                out.append(source[i : i + 2])
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            # A `]` right after `[` or `[^` is a literal in Python, the end of an empty class in
            # JavaScript: none of the ported patterns has one.
        elif source.startswith("(?<", i) and source[i + 3] not in "=!":
            out.append("(?P<")
            i += 3
            continue
        out.append(c)
        i += 1
    return "".join(out)


def compile_js(source: str, flags: str = "") -> re.Pattern[str]:
    """`source` (a JavaScript pattern, as written between the slashes) with its `i` flag; `g`
    and `y` are the caller's business (sub/subn, or match at a position)."""
    py_flags = re.ASCII
    if "i" in flags:
        py_flags |= re.IGNORECASE
    return re.compile(translate(source), py_flags)


def has_astral(text: str) -> bool:
    # Two UTF-16 code units for some character: quicker than a scan for one.
    return len(text.encode("utf-16-le", "surrogatepass")) != 2 * len(text)


def to_code_units(text: str) -> str:
    """`text` with each character past U+FFFF as its two surrogates, as JavaScript sees it."""
    return _ASTRAL.sub(_surrogate_pair, text)


def from_code_units(units: str) -> str:
    """The inverse: surrogate pairs back to one character; lone surrogates stay."""
    return units.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")


def _surrogate_pair(match: re.Match[str]) -> str:
    point = ord(match.group()) - 0x10000
    return chr(0xD800 + (point >> 10)) + chr(0xDC00 + (point & 0x3FF))
