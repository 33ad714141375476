"""What an agent would contribute: the trace as the reference SDK's capture step sends it, what
that step redacted, what it leaves in place, and how each text field reads to the SDK's
injection classifier (docs/contribution.md).

The capture step (`KPCapture.scoreAndContribute`, `packages/sdk/src/capture.ts` of the
KnowledgePulse SDK, github.com/chesterkuo/OpenKnowledgePulse, Apache License 2.0) sets
`metadata.quality_score` to the score, then for each step cleans `content` and
`output_summary` with `cleanPii` at the trace's `privacy_level`, and `input` as its
`JSON.stringify` text, parsed back with `JSON.parse` (the input is kept as it was when the
cleaned text no longer parses). It cleans nothing else: the objective, the outcome, the
metadata, a tool's name go as they are; here they are read for the same findings (`uncleaned`)
and, on request, cleaned the same way, string by string (an object's keys too).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from app.contribution.injection import Assessment, classify_all
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


@dataclass(frozen=True, slots=True)
class Finding:
    """`count` matches of a `type` (the SDK's: api_key, email, ...) at `path` (RFC 6901)."""

    path: str
    type: str
    count: int


@dataclass(frozen=True, slots=True)
class FieldRisk:
    path: str
    assessment: Assessment


@dataclass(frozen=True, slots=True)
class Gate:
    contribution: dict[str, Any]
    #: What the capture step redacted (and, with `clean_all`, the other fields' findings).
    redactions: tuple[Finding, ...]
    #: Secrets and identifiers in what the capture step sends as it was.
    uncleaned: tuple[Finding, ...]
    #: Inputs sent as they were: their cleaned JSON text no longer parsed.
    inputs_kept: tuple[str, ...]
    injection: tuple[FieldRisk, ...]

    @property
    def highest(self) -> FieldRisk | None:
        """The riskiest field (the first of equals), None without text fields."""
        best: FieldRisk | None = None
        for field in self.injection:
            if best is None or field.assessment.score > best.assessment.score:
                best = field
        return best


def pointer_token(key: str) -> str:
    """A key as a JSON Pointer reference token (RFC 6901: `~` as `~0`, `/` as `~1`)."""
    return key.replace("~", "~0").replace("/", "~1")


def _js_truthy(value: Any) -> bool:
    return isinstance(value, dict | list) or bool(value)


def _note(findings: list[Finding], path: str, cleaned: Cleaned) -> None:
    findings.extend(Finding(path, r.type, r.count) for r in cleaned.redactions)


def prepare(
    trace: dict[str, Any], *, quality_score: float | None = None, clean_all: bool = False
) -> Gate:
    """The gate's findings for `trace` (as parsed from the agent's JSON). `quality_score`:
    set as `metadata.quality_score` (the capture step sets the score it computed)."""
    sent: dict[str, Any] = as_sent(trace)
    metadata = sent.get("metadata")
    level = metadata.get("privacy_level") if isinstance(metadata, dict) else None
    level = level if isinstance(level, str) else None
    if quality_score is not None and isinstance(metadata, dict):
        metadata["quality_score"] = js_value(quality_score)
    redactions: list[Finding] = []
    kept: list[str] = []
    captured: set[tuple[int, str]] = set()
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
        if "input" in step and _js_truthy(given):
            cleaned = clean_pii(stringify(given), level)
            try:
                step["input"] = parse(cleaned.text)
            except ValueError:
                kept.append(f"/steps/{i}/input")
            else:
                _note(redactions, f"/steps/{i}/input", cleaned)
                captured.add((i, "input"))
    others: list[Finding] = []
    sent = _clean_rest(sent, level, captured, others, apply=clean_all)
    if clean_all:
        redactions += others
        others = []
    return Gate(
        contribution=sent,
        redactions=tuple(redactions),
        uncleaned=tuple(others),
        inputs_kept=tuple(kept),
        injection=_risks(list(text_fields(trace))),
    )


def _risks(fields: list[tuple[str, str]]) -> tuple[FieldRisk, ...]:
    found = classify_all([text for _, text in fields])
    return tuple(FieldRisk(path, a) for (path, _), a in zip(fields, found, strict=True))


def _clean_rest(
    sent: dict[str, Any],
    level: str | None,
    captured: set[tuple[int, str]],
    findings: list[Finding],
    *,
    apply: bool,
) -> dict[str, Any]:
    """Every string the capture step did not clean, read (and with `apply`, cleaned)."""
    out: dict[str, Any] = {}
    for key, value in sent.items():
        path = f"/{pointer_token(key)}"
        name = _key(key, path, level, findings, apply)
        if key == "steps" and isinstance(value, list):
            steps = []
            for i, step in enumerate(value):
                if not isinstance(step, dict):
                    steps.append(_leaves(step, f"/steps/{i}", level, findings, apply))
                    continue
                kept_step = {}
                for field_key, field in step.items():
                    at = f"/steps/{i}/{pointer_token(field_key)}"
                    kept_step[_key(field_key, at, level, findings, apply)] = (
                        field
                        if (i, field_key) in captured
                        else _leaves(field, at, level, findings, apply)
                    )
                steps.append(kept_step)
            out[name] = steps
        else:
            out[name] = _leaves(value, path, level, findings, apply)
    return out


def _key(key: str, path: str, level: str | None, findings: list[Finding], apply: bool) -> str:
    """An object's key, read (and with `apply`, cleaned); its findings at its member."""
    cleaned = clean_pii(key, level)
    _note(findings, path, cleaned)
    return cleaned.text if apply else key


def _leaves(value: Any, path: str, level: str | None, findings: list[Finding], apply: bool) -> Any:
    if isinstance(value, str):
        cleaned = clean_pii(value, level)
        _note(findings, path, cleaned)
        return cleaned.text if apply else value
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            at = f"{path}/{pointer_token(key)}"
            out[_key(key, at, level, findings, apply)] = _leaves(item, at, level, findings, apply)
        return out
    if isinstance(value, list):
        return [
            _leaves(item, f"{path}/{i}", level, findings, apply) for i, item in enumerate(value)
        ]
    return value


def _not_utf8(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a surrogate: the only str that UTF-8 cannot encode
        return True
    return False


def lone_surrogate(value: Any, at: tuple[str | int, ...] = ()) -> tuple[str | int, ...] | None:
    """Where the first string (or key: then its member) holding a lone surrogate is, which
    JSON can escape and JavaScript holds but UTF-8 cannot carry; None when none does."""
    if isinstance(value, str):
        return at if _not_utf8(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            found = lone_surrogate(key, (*at, key)) or lone_surrogate(item, (*at, key))
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = lone_surrogate(item, (*at, i))
            if found is not None:
                return found
    return None


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
