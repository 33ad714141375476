"""The gate's cleaning and classifier are the reference SDK's, to the character: every fixture
of tests/fixtures/contribution/ (made by running the SDK's own code, README.md there) comes
out equal; and they do bounded work on hostile text, where the SDK's patterns backtrack."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from app.contribution import js_json
from app.contribution.capture import prepare, text_fields
from app.contribution.injection import MAX_SCORE, classify_all
from app.contribution.pii import clean_pii
from app.schemas.limits import lone_surrogate

FIXTURES = Path(__file__).parent / "fixtures" / "contribution"


def _rows(name: str) -> list[dict[str, Any]]:
    with (FIXTURES / name).open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines]


PII = _rows("pii.jsonl")
INJECTION = _rows("injection.jsonl")
CAPTURE = _rows("capture.jsonl")


#: Rows per test: thousands of one-row tests would cost the suite seconds of overhead alone.
CHUNK = 50


def _chunks(rows: list[dict[str, Any]]) -> list[Any]:
    return [
        pytest.param(rows[at : at + CHUNK], id=f"rows-{at}-{min(at + CHUNK, len(rows)) - 1}")
        for at in range(0, len(rows), CHUNK)
    ]


@pytest.mark.parametrize("rows", _chunks(PII))
def test_clean_pii_is_the_sdks(rows: list[dict[str, Any]]) -> None:
    wrong = []
    for row in rows:
        cleaned = clean_pii(row["input"], row["level"])
        got = [{"type": r.type, "count": r.count} for r in cleaned.redactions]
        if cleaned.text != row["cleaned"] or got != row["redactions"]:
            wrong.append((row["id"], row["level"], cleaned.text[:200], got))
    assert wrong == []


def _options(row: dict[str, Any]) -> dict[str, float]:
    given = row["options"] or {}
    names = {"rejectThreshold": "reject_threshold", "suspiciousThreshold": "suspicious_threshold"}
    return {names[k]: v for k, v in given.items()}


@pytest.mark.parametrize("rows", _chunks(INJECTION))
def test_classify_injection_risk_is_the_sdks(rows: list[dict[str, Any]]) -> None:
    wrong = []
    for row in rows:
        (a,) = classify_all([row["content"]], **_options(row))
        got = {"score": a.score, "maxScore": a.max_score, "patterns": list(a.patterns)}
        got["verdict"] = a.verdict
        if got != row["assessment"]:
            wrong.append((row["id"], row["options"], got))
    assert wrong == []


def test_classify_all_is_classify_each() -> None:
    """Rules set aside for a group of texts (none holds their words) match none of them."""
    contents = [r["content"] for r in INJECTION if r["options"] is None]
    each = [classify_all([c])[0] for c in contents]
    assert classify_all(contents) == each
    for start in range(0, len(contents), 7):  # small groups: more rules set aside
        assert classify_all(contents[start : start + 7]) == each[start : start + 7]


def _pointer(field: str) -> str:
    match = re.fullmatch(r"steps\[(\d+)\]\.(\w+)", field)
    assert match is not None
    return f"/steps/{match[1]}/{match[2]}"


@pytest.mark.parametrize("row", CAPTURE, ids=[r["id"] for r in CAPTURE])
def test_the_contribution_is_what_capture_sends(row: dict[str, Any]) -> None:
    gate = prepare(row["trace"])
    # As JSON text written by JavaScript: its numbers and key order.
    assert js_json.stringify(gate.contribution) == js_json.stringify(row["contributed"])
    kept = [_pointer(f) for f in row["input_reparse_failed"]]
    assert list(gate.inputs_kept) == kept
    expected: dict[str, list[dict[str, Any]]] = {
        _pointer(f): found
        for f, found in row["redactions_by_field"].items()
        if found and _pointer(f) not in kept
    }
    redacted: dict[str, list[dict[str, Any]]] = {}
    for f in gate.redactions:
        redacted.setdefault(f.path, []).append({"type": f.type, "count": f.count})
    assert redacted == expected


def test_the_fixtures_cover_what_bites() -> None:
    """What the README lists is in the fixtures, so that the tests above do test it."""
    levels = {r["level"] for r in PII}
    assert levels == {None, "aggregated", "federated", "private"}
    assert any(r["input_reparse_failed"] for r in CAPTURE)
    assert any(len(r["input"]) >= 10_000 for r in PII)
    assert any(re.search("[\ud800-\udfff]", r["input"]) for r in PII)
    assert MAX_SCORE == 5.550000000000003


def test_quality_score_and_js_numbers() -> None:
    trace = CAPTURE[0]["trace"]
    gate = prepare(trace, quality_score=0.8125)
    assert gate.contribution["metadata"]["quality_score"] == 0.8125
    assert gate.contribution["steps"] is not trace["steps"]  # the agent's trace is not touched
    assert (
        js_json.stringify(
            {"b": 1e-7, "1": -0.0, "a": [1.0, 1e21, 123456789012345678901, float("inf")]}
        )
        == '{"1":0,"b":1e-7,"a":[1,1e+21,123456789012345680000,null]}'
    )
    assert js_json.stringify("\ud800\x1f\u2028é") == '"\\ud800\\u001f\u2028é"'


def test_uncleaned_finds_what_capture_leaves_and_clean_all_cleans_it() -> None:
    trace = {
        "token=s3cr3tvalue": 1,  # an unknown key: kept by the schema, read here too
        "metadata": {"privacy_level": "aggregated", "agent_id": "ops@example.com"},
        "task": {"objective": "deploy with sk-abcdefghijklmnopqrstuvwxyz"},
        "steps": [{"step_id": 0, "type": "thought", "content": "call +14155552671"}],
        "outcome": {"result_summary": "sent to 10.0.0.1", "confidence": 1},
    }
    gate = prepare(trace)
    assert [(f.path, f.type) for f in gate.redactions] == [("/steps/0/content", "phone")]
    assert [(f.path, f.type) for f in gate.uncleaned] == [
        ("/token=s3cr3tvalue", "password"),
        ("/metadata/agent_id", "email"),
        ("/task/objective", "api_key"),
        ("/outcome/result_summary", "ip"),
    ]
    assert gate.contribution["task"]["objective"] == trace["task"]["objective"]
    cleaned = prepare(trace, clean_all=True)
    assert cleaned.uncleaned == ()
    assert len(cleaned.redactions) == 5
    assert "token=[REDACTED:password]" in cleaned.contribution
    assert cleaned.contribution["task"]["objective"] == "deploy with [REDACTED:api_key]"
    assert cleaned.contribution["metadata"]["agent_id"] == "[REDACTED:email]"


def test_a_kept_input_is_reported_leaf_by_leaf_and_cleaned_so_on_request() -> None:
    # The password's value stops at the escaped quote: `\"` loses its backslash.
    step = {"step_id": 0, "type": "tool_call", "input": {"a/b": ['password=abc"def', "ok"]}}
    trace = {"metadata": {"privacy_level": "private"}, "steps": [step]}
    gate = prepare(trace)
    assert gate.inputs_kept == ("/steps/0/input",)
    assert gate.contribution["steps"][0]["input"] == step["input"]
    assert [(f.path, f.type) for f in gate.uncleaned] == [("/steps/0/input/a~1b/0", "password")]
    cleaned = prepare(trace, clean_all=True)
    assert cleaned.contribution["steps"][0]["input"] == {
        "a/b": ['password=[REDACTED:password]"def', "ok"]
    }


def test_injection_reads_each_text_field_as_sent() -> None:
    trace = CAPTURE[0]["trace"]
    gate = prepare(trace)
    paths = [f.path for f in gate.injection]
    assert paths == [p for p, _ in text_fields(trace)]
    assert "/id" not in paths
    assert "/task/objective" in paths
    assert "/steps/0/type" not in paths
    highest = gate.highest
    assert highest is not None
    assert highest.assessment.score == max(f.assessment.score for f in gate.injection)
    assert highest.assessment.verdict != "safe"


def test_lone_surrogates_are_found_where_they_are() -> None:
    assert lone_surrogate({"a": [{"b": "x\udc00"}]}) == ("a", 0, "b")
    assert lone_surrogate({"k\ud800": 1}) == ("k\ud800",)
    assert lone_surrogate({"a": "😀 é"}) is None


# -- bounded work -----------------------------------------------------------------------------

#: Shapes that make a backtracking engine retry from every position (the SDK's email pattern
#: over letters or digits, whitespace runs before a line-start rule, ...), and dense hits.
HOSTILE: dict[str, Callable[[int], str]] = {
    "letters": lambda n: "a" * n,
    "digits": lambda n: "7" * n,
    "local parts and @": lambda n: ("ab.c" * n)[: n // 2] + "@" + "x" * (n // 2),
    "@ without dots": lambda n: ("a@" * n)[:n],
    "newlines": lambda n: "\n" * n,
    "indented lines": lambda n: ("\n  - " * n)[:n],
    "spaces then words": lambda n: " " * (n - 3) + "act",
    "base64 runs of 99": lambda n: (("A" * 99 + " ") * n)[:n],
    "phone-like digits": lambda n: ("555-234-567 " * n)[:n],
    "keys without values": lambda n: ("password=;" * n)[:n],
    "an open quote": lambda n: ("token='" + "x " * n)[:n],
    "schemes": lambda n: ("redis://" * n)[:n],
    "ignore ignore": lambda n: ("ignore " * n)[:n],
    "fences": lambda n: ("```" + "x" * n)[:n],
}


def _cost(text: str) -> float:
    best = float("inf")
    for _ in range(3):
        started = time.process_time()
        clean_pii(text)
        classify_all([text])
        best = min(best, time.process_time() - started)
    return best


@pytest.mark.parametrize("shape", HOSTILE)
def test_hostile_text_costs_linear_work(shape: str) -> None:
    """Eight times the text costs about eight times the work, not sixty-four (quadratic); the
    bound is generous (a busy machine times noisily), the quadratic case far past it. The
    SDK takes seconds on 50 KB of letters; 40 KB here gives a quadratic pattern 8e8 steps."""
    small, large = (HOSTILE[shape](n) for n in (40_000, 320_000))
    base = max(_cost(small), 2e-3)
    assert _cost(large) < 24 * base
