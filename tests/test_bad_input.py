"""Bad input: every malformed payload is a 4xx naming the field, and changes nothing."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from app.core.config import Settings
from app.main import create_app
from app.schemas.limits import json_problem, limit_problems
from app.schemas.trace import ReasoningTrace
from tests.conftest import ClientFactory
from tests.factories import make_trace

Trace = dict[str, Any]


def _set(path: tuple[Any, ...], value: Any) -> Callable[[Trace], Trace]:
    def mutate(trace: Trace) -> Trace:
        target = trace
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return trace

    return mutate


def _drop(path: tuple[Any, ...]) -> Callable[[Trace], Trace]:
    def mutate(trace: Trace) -> Trace:
        target = trace
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
        return trace

    return mutate


# (name, mutation, the loc the answer must name)
FIELD_CASES: list[tuple[str, Callable[[Trace], Trace], list[Any]]] = [
    ("context missing", _drop(("@context",)), ["body", "@context"]),
    ("context other", _set(("@context",), "https://schema.org"), ["body", "@context"]),
    ("type other", _set(("@type",), "ToolCallPattern"), ["body", "@type"]),
    ("id prefix", _set(("id",), "trace:1"), ["body", "id"]),
    ("id number", _set(("id",), 123), ["body", "id"]),
    ("metadata missing", _drop(("metadata",)), ["body", "metadata"]),
    (
        "created_at words",
        _set(("metadata", "created_at"), "yesterday"),
        ["body", "metadata", "created_at"],
    ),
    (
        "created_at month 13",
        _set(("metadata", "created_at"), "2025-13-45T10:00:00Z"),
        ["body", "metadata", "created_at"],
    ),
    (
        "created_at date only",
        _set(("metadata", "created_at"), "2025-06-15"),
        ["body", "metadata", "created_at"],
    ),
    (
        "created_at with an offset",  # the reference's zod: the Z form only
        _set(("metadata", "created_at"), "2025-06-15T10:00:00.123456+02:00"),
        ["body", "metadata", "created_at"],
    ),
    (
        "created_at February 30",
        _set(("metadata", "created_at"), "2025-02-30T10:00:00Z"),
        ["body", "metadata", "created_at"],
    ),
    ("domain empty", _set(("metadata", "task_domain"), ""), ["body", "metadata", "task_domain"]),
    ("domain missing", _drop(("metadata", "task_domain")), ["body", "metadata", "task_domain"]),
    ("success string", _set(("metadata", "success"), "true"), ["body", "metadata", "success"]),
    ("success number", _set(("metadata", "success"), 1), ["body", "metadata", "success"]),
    (
        "quality above 1",
        _set(("metadata", "quality_score"), 1.5),
        ["body", "metadata", "quality_score"],
    ),
    (
        "quality string",
        _set(("metadata", "quality_score"), "0.5"),
        ["body", "metadata", "quality_score"],
    ),
    ("visibility", _set(("metadata", "visibility"), "public"), ["body", "metadata", "visibility"]),
    (
        "privacy",
        _set(("metadata", "privacy_level"), "secret"),
        ["body", "metadata", "privacy_level"],
    ),
    (
        "validated_by string",
        _set(("metadata", "validated_by"), "kp:validator:1"),
        ["body", "metadata", "validated_by"],
    ),
    ("objective empty", _set(("task", "objective"), ""), ["body", "task", "objective"]),
    ("task missing", _drop(("task",)), ["body", "task"]),
    ("input_schema array", _set(("task", "input_schema"), []), ["body", "task", "input_schema"]),
    ("steps empty", _set(("steps",), []), ["body", "steps"]),
    ("steps string", _set(("steps",), "thought"), ["body", "steps"]),
    ("step_id negative", _set(("steps", 0, "step_id"), -1), ["body", "steps", 0, "step_id"]),
    ("step_id fraction", _set(("steps", 0, "step_id"), 1.5), ["body", "steps", 0, "step_id"]),
    ("step_id string", _set(("steps", 1, "step_id"), "1"), ["body", "steps", 1, "step_id"]),
    ("step type", _set(("steps", 2, "type"), "action"), ["body", "steps", 2, "type"]),
    (
        "tool without name",
        _set(("steps", 1, "tool"), {"mcp_server": "x"}),
        ["body", "steps", 1, "tool", "name"],
    ),
    ("tool string", _set(("steps", 1, "tool"), "search"), ["body", "steps", 1, "tool"]),
    ("latency negative", _set(("steps", 0, "latency_ms"), -5), ["body", "steps", 0, "latency_ms"]),
    ("content number", _set(("steps", 0, "content"), 42), ["body", "steps", 0, "content"]),
    ("input string", _set(("steps", 0, "input"), "x"), ["body", "steps", 0, "input"]),
    (
        "confidence above 1",
        _set(("outcome", "confidence"), 1.01),
        ["body", "outcome", "confidence"],
    ),
    (
        "confidence negative",
        _set(("outcome", "confidence"), -0.1),
        ["body", "outcome", "confidence"],
    ),
    ("confidence bool", _set(("outcome", "confidence"), True), ["body", "outcome", "confidence"]),
    (
        "result_summary missing",
        _drop(("outcome", "result_summary")),
        ["body", "outcome", "result_summary"],
    ),
    (
        "graph entity",
        _set(("knowledge_graph_delta",), {"entities": [{"name": "x"}], "relationships": []}),
        ["body", "knowledge_graph_delta", "entities", 0, "type"],
    ),
    (
        "graph entities null",
        _set(("knowledge_graph_delta",), {"entities": None, "relationships": []}),
        ["body", "knowledge_graph_delta", "entities"],
    ),
    (
        "graph relationship null",
        _set(("knowledge_graph_delta",), {"entities": [], "relationships": [None]}),
        ["body", "knowledge_graph_delta", "relationships", 0],
    ),
]

# Every field the reference's zod schema marks `.optional()`: it may be left out, never null.
OPTIONAL_FIELDS: list[tuple[Any, ...]] = [
    ("source_skill",),
    ("metadata", "agent_id"),
    ("metadata", "framework"),
    ("metadata", "validated_by"),
    ("task", "input_schema"),
    ("steps", 1, "content"),
    ("steps", 1, "tool"),
    ("steps", 1, "tool", "mcp_server"),
    ("steps", 1, "input"),
    ("steps", 1, "output_summary"),
    ("steps", 1, "latency_ms"),
    ("knowledge_graph_delta",),
]


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(str(key) for key in path)


def _with_every_optional_field() -> Trace:
    trace = make_trace()
    trace["source_skill"] = "kp:skill:code-review"
    trace["metadata"] |= {
        "agent_id": "agent-7",
        "framework": "langgraph",
        "validated_by": ["kp:validator:1"],
    }
    trace["task"]["input_schema"] = {"type": "object"}
    trace["steps"][1] |= {
        "tool": {"name": "search", "mcp_server": "mcp://search"},
        "input": {"query": "sql injection"},
        "output_summary": "3 hits",
        "latency_ms": 12.5,
    }
    trace["knowledge_graph_delta"] = {
        "entities": [{"name": "handler.ts", "type": "file"}],
        "relationships": [{"fact": "handler.ts builds SQL by hand", "valid_from": "2025-06-15"}],
    }
    return trace


# (name, raw body, the loc the answer must name or None for a non-field error)
RAW_CASES: list[tuple[str, bytes, list[Any] | None]] = [
    ("json array", b"[]", ["body"]),
    ("json string", b'"hello"', ["body"]),
    ("json null", b"null", ["body"]),
    ("malformed", b'{"@context": ', ["body"]),
    ("empty body", b"", ["body"]),
    ("trailing garbage", json.dumps(make_trace()).encode() + b"}", ["body"]),
    (
        "NaN",
        json.dumps(make_trace()).replace('"confidence": 1.0', '"confidence": NaN').encode(),
        ["body", "outcome", "confidence"],
    ),
    (
        "Infinity",
        json.dumps(make_trace()).replace('"confidence": 1.0', '"confidence": Infinity').encode(),
        ["body", "outcome", "confidence"],
    ),
    (
        "huge number",
        json.dumps(make_trace()).replace('"confidence": 1.0', '"confidence": 1e400').encode(),
        ["body", "outcome", "confidence"],
    ),
    ("invalid utf-8", b'{"id": "\xff\xfe"}', ["body"]),
    ("utf-16", json.dumps(make_trace()).encode("utf-16"), ["body"]),
    ("utf-16-be, no mark", json.dumps(make_trace()).encode("utf-16-be"), ["body"]),
    ("utf-32", json.dumps(make_trace()).encode("utf-32"), ["body"]),
]


@pytest.fixture(scope="module")
def primed() -> Iterator[TestClient]:
    """A service with the model loaded and two traces cached, so that changes would show."""
    with TestClient(create_app(Settings())) as client:
        client.post("/evaluate", json=make_trace(objective="first"))
        client.post("/evaluate", json=make_trace(objective="second"))
        yield client


def _state(client: TestClient) -> tuple[Any, ...]:
    stats = client.get("/cache").json()
    metrics = client.get("/metrics").text
    evaluations = [line for line in metrics.splitlines() if line.startswith("kp_evaluations_total")]
    return stats["size"], stats["adds_total"], tuple(evaluations)


def _assert_names(detail: Any, loc: list[Any]) -> None:
    assert isinstance(detail, list), detail
    assert detail
    assert all({"loc", "msg", "type"} <= set(e) for e in detail)
    assert any(e["loc"][: len(loc)] == loc for e in detail), (loc, detail)


def test_there_are_at_least_25_malformed_payloads() -> None:
    assert len(FIELD_CASES) + len(RAW_CASES) >= 25


@pytest.mark.parametrize(("name", "mutate", "loc"), FIELD_CASES, ids=[c[0] for c in FIELD_CASES])
def test_bad_field_is_named_and_changes_nothing(
    primed: TestClient, name: str, mutate: Callable[[Trace], Trace], loc: list[Any]
) -> None:
    before = _state(primed)
    r = primed.post("/evaluate", json=mutate(copy.deepcopy(make_trace())))
    assert r.status_code == 422, r.text
    _assert_names(r.json()["detail"], loc)
    assert "Traceback" not in r.text
    assert _state(primed) == before


@pytest.mark.parametrize(("name", "body", "loc"), RAW_CASES, ids=[c[0] for c in RAW_CASES])
def test_bad_body_is_a_4xx_and_changes_nothing(
    primed: TestClient, name: str, body: bytes, loc: list[Any] | None
) -> None:
    before = _state(primed)
    r = primed.post("/evaluate", content=body, headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, r.text
    if loc is not None:
        _assert_names(r.json()["detail"], loc)
    assert "Traceback" not in r.text
    assert _state(primed) == before


@pytest.mark.parametrize(
    "encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"]
)
def test_a_body_that_is_not_utf8_is_a_400_in_the_error_shape(
    primed: TestClient, encoding: str
) -> None:
    """RFC 8259: JSON between systems is UTF-8. A parser would guess UTF-16 and UTF-32 and
    score them; docs/api.md says such a body is a 400."""
    before = _state(primed)
    body = json.dumps(make_trace()).encode(encoding)
    r = primed.post("/evaluate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json() == {
        "detail": [
            {
                "loc": ["body"],
                "msg": "the body is UTF-16 or UTF-32: send JSON as UTF-8 text (RFC 8259)",
                "type": "body_not_utf8",
            }
        ]
    }
    bad = primed.post(
        "/evaluate", content=b'{"id": "\xff\xfe"}', headers={"content-type": "application/json"}
    )
    assert bad.status_code == 400
    (error,) = bad.json()["detail"]
    assert (error["loc"], error["type"]) == (["body"], "body_not_utf8")
    assert error["msg"] == "the body is not UTF-8: byte 8 (0xff) invalid start byte"
    # A UTF-8 byte order mark is UTF-8 still (RFC 8259 lets a parser ignore it).
    marked = json.dumps(make_trace()).encode("utf-8-sig")
    ok = primed.post(
        "/evaluate?dry_run=true", content=marked, headers={"content-type": "application/json"}
    )
    assert ok.status_code == 200, ok.text
    assert _state(primed)[:2] == before[:2]


def test_wrong_content_type_is_415(primed: TestClient) -> None:
    before = _state(primed)
    r = primed.post(
        "/evaluate", content=json.dumps(make_trace()), headers={"content-type": "text/plain"}
    )
    assert r.status_code == 415
    _assert_names(r.json()["detail"], ["header", "content-type"])
    assert _state(primed) == before


@pytest.mark.slow
def test_body_over_the_limit_is_413(make_client: ClientFactory) -> None:
    client = make_client(embedder="none", max_body_bytes=4096)
    big = make_trace(objective="x" * 5000)
    r = client.post("/evaluate", json=big)
    assert r.status_code == 413
    assert "KP_MAX_BODY_BYTES" in r.json()["detail"][0]["msg"]

    def chunks() -> Any:  # no Content-Length: the limit is enforced while reading
        yield json.dumps(big).encode()

    r = client.post("/evaluate", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert client.get("/metrics").text.count("kp_evaluations_total{") == 0


def test_trace_with_every_optional_field_is_valid(client_no_embedder: TestClient) -> None:
    trace = _with_every_optional_field()
    for path in OPTIONAL_FIELDS:
        parent: Any = trace
        for key in path[:-1]:
            parent = parent[key]
        assert path[-1] in parent, f"the trace does not set {_dotted(path)}"
    r = client_no_embedder.post("/evaluate", json=trace)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", OPTIONAL_FIELDS, ids=_dotted)
def test_null_for_an_optional_field_is_named_and_changes_nothing(
    primed: TestClient, path: tuple[Any, ...]
) -> None:
    before = _state(primed)
    r = primed.post("/evaluate", json=_set(path, None)(_with_every_optional_field()))
    assert r.status_code == 422, r.text
    assert r.json()["detail"] == [
        {
            "loc": ["body", *path],
            "msg": "Field may be omitted, but not null",
            "type": "null_not_allowed",
        }
    ]
    assert _state(primed) == before


@pytest.mark.parametrize("path", OPTIONAL_FIELDS, ids=_dotted)
def test_optional_field_left_out_is_fine(
    client_no_embedder: TestClient, path: tuple[Any, ...]
) -> None:
    r = client_no_embedder.post("/evaluate", json=_drop(path)(_with_every_optional_field()))
    assert r.status_code == 200, r.text


def test_null_in_a_batch_names_the_trace(primed: TestClient) -> None:
    bad = _set(("steps", 1, "content"), None)(make_trace())
    before = _state(primed)
    r = primed.post("/evaluate/batch", json={"traces": [make_trace(), bad]})
    assert r.status_code == 422
    assert [e["loc"] for e in r.json()["detail"]] == [["body", "traces", 1, "steps", 1, "content"]]
    assert _state(primed) == before


def test_unknown_fields_are_ignored(client_no_embedder: TestClient) -> None:
    trace = make_trace()
    trace["extra"] = {"anything": [1, 2]}
    trace["steps"][0]["unknown"] = True
    r = client_no_embedder.post("/evaluate", json=trace)
    assert r.status_code == 200
    assert r.json()["score"] == pytest.approx(0.57625)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        (("@context",), "https://knowledgepulse.dev/schema/v1"),
        (("metadata", "created_at"), "2025-06-15T10:00:00Z"),
        (("metadata", "created_at"), "2024-02-29T23:59:59.123456789Z"),
        (("metadata", "created_at"), "2025-06-15T10:00Z"),
        (("steps", 0, "step_id"), 3.0),
        (("steps", 0, "latency_ms"), 0),
        (("task", "objective"), "   "),
    ],
)
def test_edge_values_that_are_valid(
    client_no_embedder: TestClient, field: tuple[Any, ...], value: Any
) -> None:
    r = client_no_embedder.post("/evaluate", json=_set(field, value)(make_trace()))
    assert r.status_code == 200, r.text


def test_errors_do_not_echo_the_input(client_no_embedder: TestClient) -> None:
    trace = make_trace()
    trace["outcome"]["confidence"] = "very secret text"
    r = client_no_embedder.post("/evaluate", json=trace)
    assert r.status_code == 422
    assert "very secret text" not in r.text


def test_ten_megabyte_body_is_413(primed: TestClient) -> None:
    before = _state(primed)
    body = b'{"id": "' + b"x" * (10 * 1024 * 1024) + b'"}'
    r = primed.post("/evaluate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert _state(primed) == before


@pytest.mark.parametrize("depth", [33, 5_000, 200_000])
def test_deep_nesting_is_refused_before_parsing(primed: TestClient, depth: int) -> None:
    trace = json.dumps(make_trace()).encode()
    nested = b"[" * depth + b"]" * depth
    body = trace.replace(b'"outcome": {', b'"deep": ' + nested + b', "outcome": {')
    before = _state(primed)
    r = primed.post("/evaluate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert "KP_MAX_JSON_DEPTH" in r.json()["detail"][0]["msg"]
    assert _state(primed) == before


def test_nesting_within_the_limit_is_fine(client_no_embedder: TestClient) -> None:
    trace = make_trace()
    inner: dict[str, Any] = {}
    trace["steps"][0]["input"] = inner
    for _ in range(20):
        inner["next"] = {}
        inner = inner["next"]
    assert client_no_embedder.post("/evaluate", json=trace).status_code == 200


def test_brackets_inside_strings_do_not_count_as_nesting(client_no_embedder: TestClient) -> None:
    trace = make_trace(objective="[[[[" * 100 + '\\"{{{{' * 100)
    assert client_no_embedder.post("/evaluate", json=trace).status_code == 200


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


_tricky_text = st.text(alphabet='[]{}"\\/ab\n\u00e9', max_size=12)
_json_values = st.recursive(
    st.none() | st.integers() | _tricky_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_tricky_text, inner, max_size=4),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(_json_values, st.integers(0, 12), st.booleans())
def test_depth_check_counts_the_nesting_the_parser_sees(
    value: Any, limit: int, ascii_only: bool
) -> None:
    """Strings full of brackets, quotes and backslashes (escaped as JSON escapes them)."""
    body = json.dumps(value, ensure_ascii=ascii_only).encode()
    problem = json_problem(body, limit)
    assert (problem is not None and problem[0] == "limit_exceeded") == (_depth(value) > limit)


def test_steps_and_strings_over_the_limits_are_named(make_client: ClientFactory) -> None:
    client = make_client(embedder="none", max_steps=3, max_string_chars=50)
    many = make_trace(steps=[{"step_id": i, "type": "thought"} for i in range(4)])
    r = client.post("/evaluate", json=many)
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "steps"]
    assert "KP_MAX_STEPS" in r.json()["detail"][0]["msg"]

    long = make_trace()
    long["steps"][1]["input"] = {"query": "y" * 51}
    r = client.post("/evaluate/batch", json={"traces": [make_trace(), long]})
    assert r.status_code == 422
    (error,) = r.json()["detail"]
    assert error["loc"] == ["body", "traces", 1, "steps", 1, "input", "query"]
    assert "KP_MAX_STRING_CHARS" in error["msg"]


@settings(max_examples=200, deadline=None)
@given(
    st.text(min_size=0, max_size=400),
    st.dictionaries(st.text(max_size=30), st.text(max_size=60), max_size=3),
    st.integers(1, 1500),
    st.booleans(),
)
def test_the_body_size_shortcut_finds_every_string_the_walk_finds(
    content: str, tool_input: dict[str, str], limit: int, ascii_only: bool
) -> None:
    """limit_problems skips its walk through the strings when the body is no larger than the
    string limit; with the body's real size it names the same fields as the walk."""
    raw = make_trace()
    raw["steps"][0]["content"] = content
    raw["steps"][1]["input"] = tool_input
    ReasoningTrace.model_validate(raw)
    body = json.dumps(raw, ensure_ascii=ascii_only).encode()
    limits = Settings(max_batch=10, max_steps=100, max_string_chars=limit)
    walked = limit_problems([raw], limits, batch=False)
    assert limit_problems([raw], limits, batch=False, body_bytes=len(body)) == walked
