"""The reference SDK's `classifyInjectionRisk`, the same to the last float: heuristic rules'
weights summed, over the weight of all rules, with a verdict by thresholds.

Port of `packages/sdk/src/utils/injection-classifier.ts` of the KnowledgePulse SDK
(github.com/chesterkuo/OpenKnowledgePulse, Apache License 2.0, Copyright 2026 OpenClaw): the
rules' names, weights, order and patterns are the SDK's; the code around them is written here.
Each rule is tried only where it can match (docs/decisions/sdk-patterns-where-they-can-match.md).
A line-start rule (`(?:^|\\n)\\s*(?:[-*>]\\s*)?...`, where `\\s*` takes line feeds too) matches iff
it matches from the last line feed before its words.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from app.contribution.js_regex import JS_SPACE_NO_LF, compile_js

Verdict = Literal["safe", "suspicious", "rejected"]

#: The SDK's defaults.
REJECT_THRESHOLD: Final = 0.6
SUSPICIOUS_THRESHOLD: Final = 0.3


@dataclass(frozen=True, slots=True)
class Assessment:
    score: float
    max_score: float
    patterns: tuple[str, ...]
    verdict: Verdict


class _Text:
    """A text with what several rules read of it, made once: its lower case (ASCII letters
    fold as in the SDK's `/i`; a few others fold too, which only adds places to try)."""

    __slots__ = ("lowered", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        lowered = text.lower()
        # U+0130 lowers to two characters: positions no longer line up, every place is tried.
        self.lowered = lowered if len(lowered) == len(text) else None


Test = Callable[[_Text], bool]


@dataclass(frozen=True, slots=True)
class _Rule:
    name: str
    weight: float
    test: Test
    #: In lower case, what each match holds one of (none: anything may match); for many texts
    #: at once, a rule none of them holds a hint of is not tried on any (`classify_all`).
    hints: tuple[str, ...] = ()

    def may_match(self, lowered: str) -> bool:
        for hint in self.hints:
            if hint in lowered:
                return True
        return not self.hints


def _from_word(name: str, weight: float, source: str, *words: str) -> _Rule:
    """A case-insensitive rule whose matches begin with one of `words` (lower case): tried
    only where they occur."""
    pattern = compile_js(source, "i")

    def test(t: _Text) -> bool:
        if t.lowered is None:
            return pattern.search(t.text) is not None
        for word in words:
            at = t.lowered.find(word)
            while at != -1:
                if pattern.match(t.text, at):
                    return True
                at = t.lowered.find(word, at + 1)
        return False

    return _Rule(name, weight, test, words)


def _containing(
    name: str,
    weight: float,
    source: str,
    needles: tuple[str, ...],
    hints: tuple[str, ...] = (),
    flags: str = "i",
) -> _Rule:
    """A rule each of whose matches holds one of `needles`: the search only when one is
    there. `hints`: in lower case, as `_Rule`'s (default: the needles)."""
    pattern = compile_js(source, flags)

    def test(t: _Text) -> bool:
        for needle in needles:
            if needle in t.text:
                return pattern.search(t.text) is not None
        return False

    return _Rule(name, weight, test, hints or needles)


def _line_start(name: str, weight: float, core: str, word: str) -> _Rule:
    """A case-insensitive rule at a line's start (the module's docstring) whose `core` begins
    with `word`: two patterns each beginning with a literal (the first line, the others)."""
    space = f"[{JS_SPACE_NO_LF}]*"
    lead = f"{space}(?:[-*>]{space})?" + compile_js(core, "i").pattern
    first = re.compile(lead, re.ASCII | re.IGNORECASE)
    others = re.compile("\n" + lead, re.ASCII | re.IGNORECASE)

    def test(t: _Text) -> bool:
        return first.match(t.text) is not None or (
            "\n" in t.text and others.search(t.text) is not None
        )

    return _Rule(name, weight, test, (word,))


_BIDI = tuple(chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A)))
_ZERO_WIDTH = ("\u200b", "\u200c", "\u200d", "\ufeff")
_BLANKS = ("  ", " \t", "\t ", "\t\t")


# Base64's characters as `a`, anything else (a byte of a longer UTF-8 sequence too) as a
# space: a run of 100 is then a substring, found by one C pass and a search.
_BASE64_SHAPE = bytes(
    ord("a") if chr(b).isascii() and (chr(b).isalnum() or chr(b) in "+/=") else ord(" ")
    for b in range(256)
)
_RUN_OF_100 = b"a" * 100


def _long_base64_run(t: _Text) -> bool:
    if len(t.text) < 100:
        return False
    shape = t.text.encode("utf-8", "surrogatepass").translate(_BASE64_SHAPE)
    return _RUN_OF_100 in shape


_CODE_BLOCK = re.compile(r"```[\s\S]*?```")
_URL = compile_js(r"https?:\/\/([^\s/)\"'`]+)", "g")
_PORT = re.compile(r":[0-9]+\Z")
_SAFE_HOSTS: Final = (
    "localhost",
    "127.0.0.1",
    "example.com",
    "example.org",
    "github.com",
    "githubusercontent.com",
    "npmjs.com",
    "knowledgepulse.org",
    "openknowledgepulse.org",
    "schemas.openknowledgepulse.org",
)


def _suspicious_url_in_code_block(t: _Text) -> bool:
    """A http(s) URL inside a ``` fenced block whose host is none of the SDK's safe ones."""
    if "```" not in t.text:
        return False
    for block in _CODE_BLOCK.finditer(t.text):
        for url in _URL.finditer(block.group()):
            host = _PORT.sub("", url.group(1).lower(), count=1)
            if not any(host == safe or host.endswith(f".{safe}") for safe in _SAFE_HOSTS):
                return True
    return False


_RULES: Final[tuple[_Rule, ...]] = (
    # Instruction overrides.
    _from_word(
        "ignore-previous-instructions", 0.3, r"ignore\s+(all\s+)?previous\s+instructions", "ignore"
    ),
    _from_word(
        "forget-instructions", 0.3, r"forget\s+(all\s+)?(your\s+|prior\s+)?instructions", "forget"
    ),
    _from_word(
        "disregard-instructions",
        0.3,
        r"disregard\s+(all\s+)?(your\s+|above\s+)?instructions",
        "disregard",
    ),
    _from_word("override-prompt", 0.3, r"override\s+(your\s+|system\s+)?prompt", "override"),
    _from_word(
        "new-updated-instructions", 0.3, r"(?:new|updated)\s+instructions\s*:", "new", "updated"
    ),
    # Role play.
    _line_start("you-are-now", 0.25, r"you\s+are\s+now\s+", "you"),
    _line_start("pretend-to-be", 0.25, r"pretend\s+(?:you\s+are|to\s+be)", "pretend"),
    _line_start("act-as", 0.25, r"act\s+as\s+(?:a\s+|an\s+)?", "act"),
    _from_word("from-now-on-you", 0.25, r"from\s+now\s+on,?\s+you", "from"),
    _line_start("imagine-you-are", 0.25, r"imagine\s+you\s+are", "imagine"),
    # Chat-template delimiters.
    _containing("llama-inst-tag", 0.2, r"\[INST\]", ("[",), ("[inst]",)),
    _containing("llama-inst-close-tag", 0.2, r"\[\/INST\]", ("[",), ("[/inst]",)),
    _containing("chatml-im-start", 0.2, r"<\|im_start\|>", ("<|",), ("<|im_start|>",)),
    _containing("chatml-im-end", 0.2, r"<\|im_end\|>", ("<|",), ("<|im_end|>",)),
    _containing("llama-sys-open", 0.2, r"<<SYS>>", ("<<",), ("<<sys>>",)),
    _containing("llama-sys-close", 0.2, r"<<\/SYS>>", ("<<",), ("<</sys>>",)),
    _containing("system-tag-bracket", 0.2, r"\[SYSTEM\]", ("[",), ("[system]",)),
    _containing("markdown-role-header", 0.2, r"###\s*(?:System|Human|Assistant)\s*:", ("###",)),
    # Hidden content.
    _Rule("long-base64-block", 0.15, _long_base64_run),
    _containing("bidi-override-chars", 0.15, r"[\u202A-\u202E\u2066-\u2069]", _BIDI, flags=""),
    _containing(
        "zero-width-steganography",
        0.15,
        r"(?:\u200B|\u200C|\u200D|\uFEFF){3,}",
        _ZERO_WIDTH,
        flags="",
    ),
    _containing("excessive-whitespace-encoding", 0.15, r"[ \t]{21,}", _BLANKS, flags=""),
    # Exfiltration.
    _from_word("send-data-pattern", 0.2, r"send\s+(?:this|the|all)\s+(?:to|via)\b", "send"),
    _from_word(
        "output-to-endpoint",
        0.2,
        r"output\s+(?:(?:to|the)\s+)+(?:following|this)\s+(?:url|endpoint|webhook)",
        "output",
    ),
    _Rule("suspicious-url-in-code-block", 0.2, _suspicious_url_in_code_block, ("```",)),
)

#: In a text shorter than 100 (the base64 rule's least), what some rule's every match holds,
#: in lower case: a short text without any matches nothing.
_QUIET = re.compile(
    "ignore|forget|disregard|override|new|updated|you|pretend|act|from|imagine|send|output"
    "|[\\[<#`\u200b-\u200d\ufeff\u202a-\u202e\u2066-\u2069]|[ \t][ \t]"
)

#: The raw score when every rule fires, summed as the SDK sums it.
MAX_SCORE: Final = sum(rule.weight for rule in _RULES)


def _js_round(value: float) -> float:
    """`Math.round`: to the nearest integer, halves up."""
    floor = math.floor(value)
    return float(floor + 1 if value - floor >= 0.5 else floor)


def classify_all(
    contents: Sequence[str],
    *,
    reject_threshold: float = REJECT_THRESHOLD,
    suspicious_threshold: float = SUSPICIOUS_THRESHOLD,
) -> list[Assessment]:
    """The SDK's `classifyInjectionRisk` of each, the rules that none of them holds a hint of
    set aside once for all."""
    lowered = "\x00".join(contents).lower()
    rules = tuple(rule for rule in _RULES if rule.may_match(lowered))
    return [_classify(c, rules, reject_threshold, suspicious_threshold) for c in contents]


def _classify(
    content: str, rules: tuple[_Rule, ...], reject_threshold: float, suspicious_threshold: float
) -> Assessment:
    raw = 0.0
    matched: list[str] = []
    text = _Text(content)
    lowered = text.lowered or content.lower()
    if len(content) >= 100 or _QUIET.search(lowered) is not None:
        for rule in rules:
            if rule.may_match(lowered) and rule.test(text):
                raw += rule.weight
                matched.append(rule.name)
    score = min(raw / MAX_SCORE, 1.0)
    verdict: Verdict = "safe"
    if score >= reject_threshold:
        verdict = "rejected"
    elif score >= suspicious_threshold:
        verdict = "suspicious"
    return Assessment(_js_round(score * 1000) / 1000, MAX_SCORE, tuple(matched), verdict)
