"""The reference SDK's `cleanPii`, the same to the character (docs/contribution.md).

Port of `packages/sdk/src/utils/pii-cleaner.ts` of the KnowledgePulse SDK
(github.com/chesterkuo/OpenKnowledgePulse, Apache License 2.0, Copyright 2026 OpenClaw): the
patterns, their order and replacements are the SDK's; the code around them is written here.
As in the SDK, each pattern replaces every match in the text the ones before it left. Text is
matched as JavaScript does, as UTF-16 code units (js_regex.py); a pattern is tried only where
a match can start (docs/decisions/sdk-patterns-where-they-can-match.md).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Final, Literal, Self

from app.contribution.js_regex import compile_js, from_code_units, has_astral, to_code_units

Category = Literal["secret", "identifier"]


@dataclass(frozen=True, slots=True)
class Redaction:
    type: str
    count: int


@dataclass(frozen=True, slots=True)
class Cleaned:
    text: str
    redactions: tuple[Redaction, ...]


Replacement = str | Callable[[re.Match[str]], str]


@dataclass(frozen=True, slots=True)
class _Rule:
    type: str
    category: Category
    pattern: re.Pattern[str]
    replacement: Replacement
    #: Every match holds one of these: without any, the rule is not run (most text has none).
    needs: tuple[str, ...] = ()
    #: Instead of `needs`: a text whose UTF-8 translated by the table has no match of the
    #: bytes pattern holds no match (one C pass).
    shape: tuple[bytes, re.Pattern[bytes]] | None = None
    #: Where a match can start (ascending; a superset is fine): the pattern is tried there
    #: alone, not at every position, with the same matches as a global replace (the leftmost
    #: match from where the previous one ended). None from it: so many places that the
    #: engine's own scan is quicker.
    starts: Callable[[str], Iterable[int] | None] | None = None

    def applies(self, text: str) -> bool:
        if self.shape is not None:
            table, pattern = self.shape
            return (
                pattern.search(text.encode("utf-8", "surrogatepass").translate(table)) is not None
            )
        for needle in self.needs:
            if needle in text:
                return True
        return not self.needs

    def subn(self, text: str) -> tuple[str, int]:
        starts = None if self.starts is None or len(text) <= _SHORT else self.starts(text)
        if starts is None:
            return self.pattern.subn(self.replacement, text)
        pieces: list[str] = []
        count = last = 0
        for at in starts:
            if at < last:
                continue
            match = self.pattern.match(text, at)
            if match is None:
                continue
            replacement = self.replacement
            pieces += (
                text[last:at],
                replacement if isinstance(replacement, str) else replacement(match),
            )
            last = match.end()
            count += 1
        if not count:
            return text, 0
        pieces.append(text[last:])
        return "".join(pieces), count

    @classmethod
    def of(
        cls,
        type_: str,
        category: Category,
        source: str,
        *needs: str,
        flags: str = "g",
        replacement: Replacement = "",
        shape: tuple[bytes, re.Pattern[bytes]] | None = None,
        starts: Callable[[str], Iterable[int] | None] | None = None,
    ) -> Self:
        """The SDK's pattern `source` (as written between its slashes) with its `flags`,
        replaced by `[REDACTED:<type>]` unless `replacement` says otherwise."""
        pattern = compile_js(source, flags)
        replacement = replacement or f"[REDACTED:{type_}]"
        return cls(type_, category, pattern, replacement, needs, shape, starts)


#: A pattern tried at a place costs about as much as the engine's scan over this many
#: characters: past one place in so many, the scan is used instead.
_PLACES_PER_SCAN = 200
#: The same for checking the keys that end before a separator.
_PLACES_PER_KEY = 100
#: Text this short is scanned by the engine at once: finding the places would cost more.
_SHORT = 512


def _occurrences(haystack: str, needle: str) -> Iterator[int]:
    at = haystack.find(needle)
    while at != -1:
        yield at
        at = haystack.find(needle, at + 1)


def _windows(anchors: Iterator[int], before: int, after: int) -> Iterator[int]:
    """Each position from `before` ahead of an anchor to `after` past it, once, ascending."""
    upto = 0
    for anchor in anchors:
        yield from range(max(upto, anchor - before, 0), anchor + after + 1)
        upto = max(upto, anchor + after + 1)


#: The password rule's keys; a match is one, then JavaScript white space, then `=` or `:`.
_KEYS_SOURCE = "password|passwd|secret|token|api_key|apikey|api_secret|access_token|auth_token"
_KEYS = _KEYS_SOURCE.split("|")
_PASSWORD_SOURCE = (
    rf"\b(?<key>{_KEYS_SOURCE})(?<sep>\s*[=:]\s*)(?!\[REDACTED)(?:(?<qchar>['\"])(?<qval>[^'\"]*)"
    r"\k<qchar>|(?<uval>[^\s'\"`,;)}\[\]]{2,}))"
)
_SPACE = frozenset(
    "\t\n\v\f\r \u00a0\u1680\u2028\u2029\u202f\u205f\u3000\ufeff"
    + "".join(chr(c) for c in range(0x2000, 0x200B))
)


def _password_starts(text: str) -> Iterable[int] | None:
    """Found from the separators (few in most text): back over the white space before each,
    then each key that ends there (any case: the pattern decides)."""
    if (text.count("=") + text.count(":")) * _PLACES_PER_KEY > len(text):
        return None
    found: set[int] = set()
    for separator in "=:":
        at = text.find(separator)
        while at != -1:
            end = at
            while end and text[end - 1] in _SPACE:
                end -= 1
            for key in _KEYS:
                start = end - len(key)
                if start >= 0 and text[start:end].lower() == key:
                    found.add(start)
            at = text.find(separator, at + 1)
    return sorted(found)


# What ends every US phone match: 3 digits, a separator, 4 digits; the match starts at most 10
# characters before it.
_PHONE_TAIL = compile_js(r"[0-9][0-9][0-9][-.\s][0-9]{4}")  # [0-9] first: a quick scan


def _shape_table(classes: dict[bytes, bytes]) -> bytes:
    """A bytes.translate table: ASCII as its class's mark (else x), other bytes unchanged."""
    table = bytearray(b"x" * 128 + bytes(range(128, 256)))
    for members, mark in classes.items():
        for byte in members:
            table[byte] = mark[0]
    return bytes(table)


# A text's UTF-8 as the shapes the phone and IPv4 patterns need, in one C pass: ASCII digits as
# 0, the phone's ASCII separators ([-.] and white space) as s, the dots as dots, other ASCII as
# x; non-ASCII bytes as they are, so that JavaScript's non-ASCII white space (U+00A0, U+1680,
# U+2000-U+200A, U+2028, U+2029, U+202F, U+205F, U+3000, U+FEFF) is still seen between digits.
_PHONE_SHAPE = _shape_table({b"0123456789": b"0", b"-. \t\n\v\f\r": b"s"})
_PHONE_IN_SHAPE = re.compile(
    rb"000(?:s|\xc2\xa0|\xe1\x9a\x80|\xe2\x80[\x80-\x8a\xa8\xa9\xaf]|\xe2\x81\x9f"
    rb"|\xe3\x80\x80|\xef\xbb\xbf)0000"
)
_IPV4_SHAPE = _shape_table({b"0123456789": b"0", b".": b"."})
_IPV4_IN_SHAPE = re.compile(rb"0\.0{1,3}\.0{1,3}\.0")


def _phone_starts(text: str) -> Iterable[int] | None:
    tails: list[int] = []
    most = len(text) // _PLACES_PER_SCAN
    # finditer skips tails overlapping a found one: their windows lie within its own.
    for match in _PHONE_TAIL.finditer(text):
        if len(tails) >= most:
            return None
        tails.append(match.start())
    return _windows(iter(tails), 10, 7)


def _password(match: re.Match[str]) -> str:
    return f"{match['key']}{match['sep']}[REDACTED:password]"


# The SDK's EMAIL pattern, and the same anchored where a run of its local-part characters
# begins (the lookbehind): the only other places a leftmost match can start.
_EMAIL_SOURCE = r"[a-zA-Z0-9._%+\-]+@[a-zA-Z0-9.\-]+\.[a-zA-Z]{2,}"
_EMAIL = compile_js(_EMAIL_SOURCE)
_EMAIL_AT_RUN_START = compile_js(r"(?<![a-zA-Z0-9._%+\-])" + _EMAIL_SOURCE)


class _EmailRule(_Rule):
    def subn(self, text: str) -> tuple[str, int]:
        """What `text.replace(EMAIL_g, ...)` gives. A match starting inside a run of local-part
        characters (after the run's first) would also match one character earlier, the local
        part being that run up to `@` and the rest the same: so from a position the leftmost
        match starts there or at a run's start. Each run is read once by the engine instead of
        once per start."""
        pieces: list[str] = []
        count = last = 0
        at = 0
        while True:
            match = _EMAIL.match(text, at) or _EMAIL_AT_RUN_START.search(text, at + 1)
            if match is None:
                break
            pieces += (text[last : match.start()], "[REDACTED:email]")
            last = at = match.end()
            count += 1
        if not count:
            return text, 0
        pieces.append(text[last:])
        return "".join(pieces), count


_RULES: Final[tuple[_Rule, ...]] = (
    # Secrets: always redacted (connection strings before the password assignments).
    _Rule.of(
        "connection_string",
        "secret",
        r"(?:postgresql|postgres|mysql|redis|rediss|mongodb|mongodb\+srv|amqp|amqps):\/\/"
        r"[^\s'\"`,)}\]]+",
        "://",
        flags="gi",
        # A scheme of 4 to 11 characters, then `://`.
        starts=lambda text: _windows(_occurrences(text, "://"), 11, -4),
    ),
    _Rule.of(
        "bearer_token",
        "secret",
        r"Bearer\s+(?!kp_)[A-Za-z0-9_\-.~+/=]{20,}",
        "Bearer",
        replacement="Bearer [REDACTED:bearer_token]",
    ),
    _Rule.of("api_key", "secret", r"sk-[A-Za-z0-9]{20,}", "sk-"),
    _Rule.of("api_key", "secret", r"gh[poas]_[A-Za-z0-9]{36,}", "ghp_", "gho_", "gha_", "ghs_"),
    _Rule.of("api_key", "secret", r"AKIA[A-Z0-9]{16}", "AKIA"),
    _Rule.of("api_key", "secret", r"kp_[a-f0-9]{16,}", "kp_"),
    _Rule.of("api_key", "secret", r"xox[bpras]-[A-Za-z0-9\-]+", "xox"),
    _Rule.of(
        "password",
        "secret",
        _PASSWORD_SOURCE,
        "=",
        ":",
        flags="gi",
        replacement=_password,
        starts=_password_starts,
    ),
    # Identifiers: redacted at "aggregated" and "federated", kept at "private".
    _EmailRule("email", "identifier", _EMAIL, "[REDACTED:email]", ("@",)),
    _Rule.of(
        "phone",
        "identifier",
        r"(?:\+?1[-.\s]?)?\(?\d{3}\)?[-.\s]?\s?\d{3}[-.\s]\d{4}\b",
        shape=(_PHONE_SHAPE, _PHONE_IN_SHAPE),
        starts=_phone_starts,
    ),
    _Rule.of("phone", "identifier", r"\+[1-9]\d{6,14}\b", "+"),
    _Rule.of(
        "ip",
        "identifier",
        r"\b(?:25[0-5]|2[0-4]\d|[01]?\d\d?)\.(?:25[0-5]|2[0-4]\d|[01]?\d\d?)\."
        r"(?:25[0-5]|2[0-4]\d|[01]?\d\d?)\.(?:25[0-5]|2[0-4]\d|[01]?\d\d?)\b",
        shape=(_IPV4_SHAPE, _IPV4_IN_SHAPE),
    ),
    _Rule.of(
        "filepath",
        "identifier",
        r"\/(?:home|Users)\/[a-zA-Z0-9._\-]+(?:\/[^\s'\"`,;)}\]]*)?",
        "/home/",
        "/Users/",
    ),
    _Rule.of(
        "filepath",
        "identifier",
        r"[A-Z]:\\Users\\[a-zA-Z0-9._\-]+(?:\\[^\s'\"`,;)}\]]*)*",
        ":\\Users\\",
        starts=lambda text: (at - 1 for at in _occurrences(text, ":\\Users\\") if at),
    ),
)


#: Something every rule's match holds (their `needs`, IPv4's and phones' digits): a text
#: without any is clean as it is, found in one scan.
_SCREEN = re.compile(r"[0-9=:@+]|Bearer|sk-|gh[poas]_|AKIA|kp_|xox|/home/|/Users/")


def clean_pii(text: str, level: str | None = None) -> Cleaned:
    """`cleanPii(text, level)`: secrets always, identifiers unless `level` is "private"
    (None: the SDK's default, "aggregated")."""
    if not text or (len(text) <= _SHORT and _SCREEN.search(text) is None):
        return Cleaned(text, ())
    astral = not text.isascii() and has_astral(text)
    cleaned = to_code_units(text) if astral else text
    counts: dict[str, int] = {}
    for rule in _RULES:
        if (level == "private" and rule.category == "identifier") or not rule.applies(cleaned):
            continue
        cleaned, n = rule.subn(cleaned)
        if n:
            counts[rule.type] = counts.get(rule.type, 0) + n
    if astral:
        cleaned = from_code_units(cleaned)
    return Cleaned(cleaned, tuple(Redaction(t, n) for t, n in counts.items()))
