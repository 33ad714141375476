"""What an agent would contribute: the trace as the reference SDK's capture step sends it, what
that step redacted, what it leaves in place, and how each text field reads to the SDK's
injection classifier (docs/contribution.md says what the step cleans and what it leaves).

The capture step is `KPCapture.scoreAndContribute` (`packages/sdk/src/capture.ts` of the
KnowledgePulse SDK, github.com/chesterkuo/OpenKnowledgePulse, Apache License 2.0).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from app.contribution.injection import (
    REJECT_THRESHOLD,
    SUSPICIOUS_THRESHOLD,
    Assessment,
    classify_all,
)
from app.contribution.js_json import as_sent, js_keys, js_value, parse, stringify
from app.contribution.pii import Cleaned, clean_pii

#: The fields the capture step cleans in each step (`input` as JSON text).
STEP_TEXT_FIELDS = ("content", "output_summary")
#: Fields of a fixed form (enumerations, ids, dates): not read as text by the classifier.
_NOT_TEXT = frozenset(
    {
        "/@context",
        "/@type",
        "/id",
        "/metadata/created_at",
        "/metadata/visibility",
        "/metadata/privacy_level",
    }
)
_STEP_TYPE = re.compile(r"/steps/[0-9]+/type")


#: How the SDK's own patterns are named as a detector.
SDK_PATTERNS = "cleanPii"


@dataclass(frozen=True, slots=True)
class Finding:
    """`count` matches of a `type` (the SDK's: api_key, email, ...; the detectors' too) at
    `path` (RFC 6901), found by `detector` (the SDK's patterns: SDK_PATTERNS)."""

    path: str
    type: str
    count: int
    detector: str = SDK_PATTERNS


@dataclass(frozen=True, slots=True)
class FieldRisk:
    path: str
    assessment: Assessment


@dataclass(frozen=True, slots=True)
class Gate:
    """Each field as the answer's of the same name (app/schemas/contribution.py)."""

    contribution: dict[str, Any]
    redactions: tuple[Finding, ...]
    uncleaned: tuple[Finding, ...]
    inputs_kept: tuple[str, ...]
    injection: tuple[FieldRisk, ...]
    findings: tuple[Finding, ...] = ()
    differs_from_sdk: bool = False

    @property
    def highest(self) -> FieldRisk | None:
        """The riskiest field (the first of equals), None without text fields."""
        return max(self.injection, key=lambda field: field.assessment.score, default=None)

    @property
    def leaks_remain(self) -> bool:
        """Whether `contribution` still holds something suspected: uncleaned or found."""
        return bool(self.uncleaned or self.findings)


def pointer_token(key: str) -> str:
    """A key as a JSON Pointer reference token (RFC 6901: `~` as `~0`, `/` as `~1`)."""
    return key.replace("~", "~0").replace("/", "~1")


def _note(findings: list[Finding], path: str, cleaned: Cleaned) -> None:
    findings.extend(Finding(path, r.type, r.count) for r in cleaned.redactions)


def prepare(
    trace: dict[str, Any],
    *,
    quality_score: float | None = None,
    clean_all: bool = False,
    redact_suspected: bool = False,
    suspicious_threshold: float = SUSPICIOUS_THRESHOLD,
    reject_threshold: float = REJECT_THRESHOLD,
) -> Gate:
    """The gate's findings for `trace` (as parsed from the agent's JSON). `quality_score`:
    set as `metadata.quality_score` (the capture step sets the score it computed);
    `clean_all`: also clean, with the SDK's patterns, every string the capture step sends as
    it was; `redact_suspected`: that, and redact every suspected leak the detectors find;
    the thresholds: the injection classifier's (the SDK's options)."""
    sent: dict[str, Any] = as_sent(trace)
    metadata = sent.get("metadata")
    level = metadata.get("privacy_level") if isinstance(metadata, dict) else None
    level = level if isinstance(level, str) else None
    if quality_score is not None and isinstance(metadata, dict):
        metadata["quality_score"] = js_value(quality_score)
    redactions: list[Finding] = []
    kept: list[str] = []
    captured: set[tuple[int, str]] = set()
    inputs: dict[int, Any] = {}  # a step's input as given, where the capture step cleaned it
    steps = sent.get("steps")
    for i, step in enumerate(steps if isinstance(steps, list) else ()):
        if not isinstance(step, dict):
            continue
        for name in STEP_TEXT_FIELDS:
            text = step.get(name)
            if isinstance(text, str) and text:
                cleaned = clean_pii(text, level)
                step[name] = cleaned.text
                _note(redactions, f"/steps/{i}/{name}", cleaned)
                captured.add((i, name))
        given = step.get("input")
        if isinstance(given, dict | list) or given:  # JavaScript's truthiness
            cleaned = clean_pii(stringify(given), level)
            try:
                step["input"] = parse(cleaned.text)
            except ValueError:
                kept.append(f"/steps/{i}/input")
            else:
                _note(redactions, f"/steps/{i}/input", cleaned)
                inputs[i] = given
    clean_all = clean_all or redact_suspected
    rest = _Rest(level, captured, inputs, clean_all)
    sent = rest.leaves(sent, "")
    # Here, not at the module's import: detect-secrets and phonenumbers take a few tenths of
    # a second to import, which the service's start would otherwise pay (as /mcp's SDK).
    from app.contribution.detectors import detect, redact

    suspects = detect(rest.texts, identifiers=level != "private")
    found = [  # each text's suspects counted by (type, detector), in order of first place
        Finding(path, type_, count, detector)
        for path, here in zip(rest.paths, suspects, strict=True)
        if here
        for (type_, detector), count in Counter((s.type, s.detector) for s in here).items()
    ]
    differs = bool(clean_all and rest.findings)
    if redact_suspected and found:
        redacted = iter([redact(text, s) for text, s in zip(rest.texts, suspects, strict=True)])
        sent = _map_strings(sent, lambda _: next(redacted))
        differs = True
    if clean_all:
        redactions += rest.findings
    if redact_suspected:
        redactions += found
    fields = list(text_fields(trace))
    risks = classify_all(
        [text for _, text in fields],
        suspicious_threshold=suspicious_threshold,
        reject_threshold=reject_threshold,
    )
    return Gate(
        contribution=sent,
        redactions=tuple(redactions),
        uncleaned=() if clean_all else tuple(rest.findings),
        inputs_kept=tuple(kept),
        injection=tuple(FieldRisk(path, a) for (path, _), a in zip(fields, risks, strict=True)),
        findings=() if redact_suspected else tuple(found),
        differs_from_sdk=differs,
    )


@dataclass(slots=True)
class _Rest:
    """What follows the capture step's loop: every string it did not clean read (and with
    `apply`, cleaned) with the SDK's patterns; and each string of the result (an object's
    keys too) as the SDK's patterns leave it, in `texts` at `paths`, for the detectors.

    A step's input was cleaned as JSON text, where escaping defeats some patterns (`\\"`
    ends a password's value, `\\\\` breaks a Windows path): each of its strings that the
    cleaning left unchanged is read again on its own, so that what the patterns find in it is
    not taken for handled."""

    level: str | None
    captured: set[tuple[int, str]]
    inputs: dict[int, Any]
    apply: bool
    findings: list[Finding] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)

    def step(self, step: Any, path: str, i: int) -> Any:
        if not isinstance(step, dict):
            return self.leaves(step, path)
        out = {}
        for key, item in step.items():
            at = f"{path}/{pointer_token(key)}"
            name = self.text(key, at)
            if (i, key) in self.captured:  # cleaned by the capture step: as it left it
                out[name] = self.handled(item, at)
            elif key == "input" and i in self.inputs:
                out[name] = self.against(item, self.inputs[i], at)
            else:
                out[name] = self.leaves(item, at)
        return out

    def handled(self, text: str, path: str) -> str:
        self.texts.append(text)
        self.paths.append(path)
        return text

    def against(self, cleaned: Any, given: Any, path: str) -> Any:
        """A cleaned input beside the input as given: a string the cleaning changed is
        handled, one it left as it was is read on its own. Where the two no longer line up
        (a cleaned key now equal to another), every string is read."""
        if isinstance(cleaned, str) and isinstance(given, str):
            return self.handled(cleaned, path) if cleaned != given else self.text(cleaned, path)
        if isinstance(cleaned, dict) and isinstance(given, dict) and len(cleaned) == len(given):
            out = {}
            for (key, item), (given_key, given_item) in zip(
                cleaned.items(), given.items(), strict=True
            ):
                at = f"{path}/{pointer_token(key)}"
                name = self.handled(key, at) if key != given_key else self.text(key, at)
                out[name] = self.against(item, given_item, at)
            return out
        if isinstance(cleaned, list) and isinstance(given, list) and len(cleaned) == len(given):
            return [
                self.against(item, given_item, f"{path}/{i}")
                for i, (item, given_item) in enumerate(zip(cleaned, given, strict=True))
            ]
        return self.leaves(cleaned, path)

    def text(self, text: str, path: str) -> str:
        cleaned = clean_pii(text, self.level)
        _note(self.findings, path, cleaned)
        self.texts.append(cleaned.text)
        self.paths.append(path)
        return cleaned.text if self.apply else text

    def leaves(self, value: Any, path: str) -> Any:
        if isinstance(value, str):
            return self.text(value, path)
        if isinstance(value, dict):
            out = {}
            for key, item in value.items():
                at = f"{path}/{pointer_token(key)}"
                name = self.text(key, at)
                if at == "/steps" and isinstance(item, list):  # the trace's steps
                    out[name] = [self.step(step, f"{at}/{i}", i) for i, step in enumerate(item)]
                else:
                    out[name] = self.leaves(item, at)
            return out
        if isinstance(value, list):
            return [self.leaves(item, f"{path}/{i}") for i, item in enumerate(value)]
        return value


def _map_strings(value: Any, change: Callable[[str], str]) -> Any:
    """`value` with each string (an object's key before its value) through `change`, in the
    order _Rest reads them."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, dict):
        return {change(key): _map_strings(item, change) for key, item in value.items()}
    if isinstance(value, list):
        return [_map_strings(item, change) for item in value]
    return value


def text_fields(trace: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """The trace's text as (JSON Pointer, string), in JavaScript's key order, but for the fields
    of a fixed form (ids, dates, enumerations). Keys are not fields."""
    if isinstance(trace, str):
        if path not in _NOT_TEXT and not (path.endswith("/type") and _STEP_TYPE.fullmatch(path)):
            yield path, trace
    elif isinstance(trace, dict):
        for key in js_keys(trace):
            yield from text_fields(trace[key], f"{path}/{pointer_token(key)}")
    elif isinstance(trace, list):
        for i, item in enumerate(trace):
            yield from text_fields(item, f"{path}/{i}")
