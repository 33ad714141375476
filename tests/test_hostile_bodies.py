"""Hostile JSON at every route, as an attacker would send it (hypothesis): lone surrogates in
keys and values at every depth, integers of thousands of digits, NaN-like tokens, arrays
10,000 deep, duplicate keys, megabyte keys. No answer is a 5xx, and an answer that refuses
(4xx) leaves the memory as it was. The real model scores what gets through, so an accepted
trace does change the memory, and the check of the refused ones can fail."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.api.errors import error_body
from app.core.config import Settings
from app.core.errors import Problem, ServiceError
from app.main import create_app
from tests.factories import make_trace
from tests.test_mcp import HEADERS as MCP_HEADERS

JSON = {"content-type": "application/json"}

#: JSON text an attacker puts where a value goes.
VALUES = [
    '"\\ud800"',
    '"a\\udfffb"',
    '"\\udc00\\ud800"',
    '"\\u0000\\u001b[2J\\u202e"',
    "NaN",
    "-Infinity",
    "Infinity",
    "1e999",
    "-0",
    "9" * 309,
    "-" + "9" * 400,
    "9" * 5000,
    "1." + "9" * 5000,
    '{"a": 1, "a": "\\ud800", "a": {"\\ud800": [NaN]}}',
    "[" * 10_000 + "]" * 10_000,
    "[" * 70 + "1" + "]" * 70,
    '{"' + "k" * 200_000 + '": 1}',
    '{"\\ud800": {"\\udfff": {"\\udbff\\udfff\\ud800": 1}}}',
    '["\\ud800", 1e999, ' + "7" * 400 + ', {"x": "\\udfff"}]',
    "true",
    "null",
    '"' + "\\ud800" * 2000 + '"',
]
#: JSON text an attacker puts where a key goes.
KEYS = ['"\\ud800"', '"\\udfff\\ud800"', '"' + "\\ud800" * 50_000 + '"', '"\\u0000"', '""']

#: Where in the trace: a path of keys from the trace's top, the last one created if missing.
PLACES = [
    ("__extra__",),
    ("steps", 0, "input"),
    ("steps", 0, "input", "headers"),
    ("steps", 1, "input", "deep", "deeper"),
    ("steps", 0, "content"),
    ("steps", 0, "__extra__"),
    ("task", "input_schema"),
    ("task", "input_schema", "properties"),
    ("task", "objective"),
    ("metadata", "task_domain"),
    ("metadata", "quality_score"),
    ("outcome", "confidence"),
    ("outcome", "__extra__"),
    ("knowledge_graph_delta",),
    ("id",),
]
ROUTES = ["/evaluate", "/evaluate/batch", "/contribution", "/mcp", "/cache/import"]
_MARK = "__hostile__"


def _hostile_text(trace: dict[str, Any], place: tuple[Any, ...], fragment: str, key: bool) -> str:
    """The trace's JSON text with `fragment` (JSON text) as the value (or, with `key`, as a
    key holding 1) at `place`."""
    target = trace
    for part in place[:-1]:
        target = target.setdefault(part, {}) if isinstance(target, dict) else target[part]
    if key:
        target[place[-1]] = {_MARK: 1}
        return json.dumps(trace).replace(f'"{_MARK}"', fragment, 1)
    target[place[-1]] = _MARK
    return json.dumps(trace).replace(f'"{_MARK}"', fragment, 1)


def _body(route: str, trace_text: str) -> tuple[str, dict[str, str]]:
    if route == "/evaluate/batch":
        return '{"traces": [' + trace_text + "]}", JSON
    if route == "/mcp":
        head = '{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": '
        call = '{"name": "kp_check_contribution", "arguments": ' + trace_text + "}}"
        return head + call, {**JSON, **MCP_HEADERS}
    if route == "/cache/import":
        line = '{"trace_id": ' + trace_text[:200_000] + ', "added_at_ms": 1, "vector": "AAAA"}'
        return line + "\n", {"content-type": "application/x-ndjson"}
    return trace_text, JSON


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    app = create_app(Settings(cache_capacity=100_000))
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


def _memory(client: TestClient) -> bytes:
    return client.get("/cache/export").content


def _refused(route: str, response: Any) -> bool:
    if response.status_code >= 400:
        return True
    if route == "/mcp":
        answer = response.json()
        return "error" in answer or bool(answer.get("result", {}).get("isError"))
    return False


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    route=st.sampled_from(ROUTES),
    place=st.sampled_from(PLACES),
    fragment=st.sampled_from(VALUES) | st.sampled_from(KEYS),
    as_key=st.booleans(),
)
def test_hostile_json_is_never_a_5xx_and_a_refusal_changes_nothing(
    client: TestClient, route: str, place: tuple[Any, ...], fragment: str, as_key: bool
) -> None:
    as_key = as_key and fragment in KEYS
    trace = make_trace(
        trace_id=f"kp:trace:{uuid.uuid4()}", objective=f"Hostile check {uuid.uuid4()}"
    )
    body, headers = _body(route, _hostile_text(trace, place, fragment, as_key))
    before = _memory(client)
    response = client.post(route, content=body.encode("utf-8"), headers=headers)
    assert response.status_code < 500, response.text[:500]
    response.json() if route != "/cache/export" else None  # every answer is JSON
    if _refused(route, response):
        assert _memory(client) == before
    elif route != "/cache/import":
        assert _memory(client) != before  # accepted and stored: the check above can fail


def test_the_checks_see_an_accepted_trace_change_the_memory(client: TestClient) -> None:
    trace = make_trace(trace_id="kp:trace:hostile-ok", objective=f"Accepted {uuid.uuid4()}")
    before = _memory(client)
    body, headers = _body("/contribution", json.dumps(trace))
    assert client.post("/contribution", content=body, headers=headers).status_code == 200
    assert _memory(client) != before


@settings(max_examples=300, deadline=None)
@given(
    loc=st.lists(st.text() | st.integers(), max_size=6),
    msg=st.text(),
    kind=st.text(max_size=40),
    huge=st.booleans(),
)
def test_an_error_answer_renders_whatever_it_carries(
    loc: list[str | int], msg: str, kind: str, huge: bool
) -> None:
    """Any text in a location or a message (lone surrogates, controls, a megabyte) renders as
    UTF-8 JSON, each string cut to a bound."""
    if huge:
        msg = msg + "\ud800" * 100_000
    error = ServiceError(422, kind, msg, problems=[Problem(tuple(loc), msg, kind)])
    rendered = json.loads(error_body(error))
    (entry,) = rendered["detail"]
    assert len(entry["msg"]) <= 256 * 6  # a bound, each character at most one escape
    plain = json.loads(error_body(ServiceError(503, kind, msg)))
    assert isinstance(plain["detail"], str)
