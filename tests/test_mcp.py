"""The MCP endpoint (/mcp): through the official MCP Python client against a live server, and
in process (raw JSON-RPC) for the limits, the overload and the metrics."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from mcp import Client, MCPError

from app.core.config import Settings
from app.main import create_app
from app.schemas.contribution import ContributionOptions, ContributionOut
from app.schemas.responses import BatchIn, BatchOut, EvaluationOut
from app.schemas.trace import ReasoningTrace
from tests.conftest import ClientFactory, hold_runs, load_fixture
from tests.factories import make_trace
from tests.server import Server

SCORE_TOLERANCE = 1e-6
NO_EMBEDDER = [c for c in load_fixture("no_embedder.json")["cases"] if c["expected_score"]]
SEQUENCE = load_fixture("embedder_sequence.json")["cases"]


async def until(condition: Callable[[], bool]) -> None:
    """Waits for a state the test arranged (the timeout only stops a broken test hanging)."""

    async def poll() -> None:
        # The state is the worker threads' (no event to await): polling it is the test's job.
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), timeout=120)


@asynccontextmanager
async def mcp_client(server: Server, mode: str = "auto") -> AsyncIterator[Client]:
    """The official client; "auto" speaks the 2026-07-28 protocol (no handshake), "legacy"
    the 2025-11-25 one (initialize first), as the TypeScript client does."""
    async with Client(f"{server.url}/mcp", mode=mode) as client:
        yield client


def call(server: Server, tool: str, arguments: dict[str, Any], mode: str = "auto") -> Any:
    async def go() -> Any:
        async with mcp_client(server, mode) as client:
            return await client.call_tool(tool, arguments)

    return asyncio.run(go())


def text_of(result: Any) -> str:
    (content,) = result.content
    assert content.type == "text"
    return str(content.text)


PROTOCOLS = pytest.mark.parametrize(
    ("mode", "version"), [("auto", "2026-07-28"), ("legacy", "2025-11-25")]
)


@PROTOCOLS
def test_the_tools_and_their_schemas_are_the_rest_apis(
    server: Server, mode: str, version: str
) -> None:
    async def go() -> Any:
        async with mcp_client(server, mode) as client:
            assert client.session.protocol_version == version
            return (await client.list_tools()).tools

    one, batch, contribution = asyncio.run(go())
    assert (one.name, batch.name) == ("kp_score_trace", "kp_score_traces")
    assert contribution.name == "kp_check_contribution"
    # The trace's fields, dry_run and namespace, and the gate's options (POST /contribution's
    # query parameters).
    options = ContributionOptions.model_json_schema()["properties"]
    assert set(options) == {"redact_suspected", "suspicious_threshold", "reject_threshold"}
    assert contribution.input_schema == {
        **one.input_schema,
        "properties": {**one.input_schema["properties"], **options},
    }
    assert contribution.output_schema == ContributionOut.model_json_schema()
    trace_schema = ReasoningTrace.model_json_schema(by_alias=True)
    own = ("dry_run", "namespace")
    assert {k: v for k, v in one.input_schema["properties"].items() if k not in own} == (
        trace_schema["properties"]
    )
    assert one.input_schema["required"] == trace_schema["required"]
    assert one.input_schema["$defs"] == trace_schema["$defs"]
    assert one.input_schema["properties"]["dry_run"]["type"] == "boolean"
    assert one.input_schema["properties"]["namespace"]["type"] == "string"
    assert (
        batch.input_schema["properties"]["traces"]
        == (BatchIn.model_json_schema(by_alias=True)["properties"]["traces"])
    )
    assert one.output_schema == EvaluationOut.model_json_schema()
    assert batch.output_schema == BatchOut.model_json_schema()


def test_reference_traces_score_as_over_rest(server: Server) -> None:
    """Every reference trace (no embedder): the tools' structured answers are the REST
    answers. The first 40 through kp_score_trace, one call each; all of them through
    kp_score_traces, in batches (one call a trace for all 590 took most of this test's time,
    and the tools share everything past the arguments' parsing)."""
    singles = NO_EMBEDDER[:40]

    async def go() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        async with mcp_client(server) as client:
            one_by_one = []
            for case in singles:
                result = await client.call_tool(
                    "kp_score_trace", {**case["trace"], "dry_run": True}
                )
                assert not result.is_error, text_of(result)
                one_by_one.append(result.structured_content)
            batched = []
            for start in range(0, len(NO_EMBEDDER), 64):
                traces = [c["trace"] for c in NO_EMBEDDER[start : start + 64]]
                result = await client.call_tool(
                    "kp_score_traces", {"traces": traces, "dry_run": True}
                )
                assert not result.is_error, text_of(result)
                batched += result.structured_content["results"]
            return one_by_one, batched

    one_by_one, batched = asyncio.run(go())
    via_rest: list[dict[str, Any]] = []
    with httpx.Client(base_url=server.url) as http:
        for start in range(0, len(NO_EMBEDDER), 64):
            traces = [c["trace"] for c in NO_EMBEDDER[start : start + 64]]
            answer = http.post("/evaluate/batch?dry_run=true", json={"traces": traces})
            via_rest += answer.json()["results"]
    assert [a["score"] for a in batched] == pytest.approx(
        [c["expected_score"] for c in NO_EMBEDDER], abs=SCORE_TOLERANCE
    )

    def drop_time(answers: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**a, "elapsed_ms": 0} for a in answers]

    assert drop_time(batched) == drop_time(via_rest)
    assert drop_time(one_by_one) == drop_time(via_rest[: len(singles)])


@pytest.mark.slow
def test_the_embedder_sequence_scores_as_the_reference(onnx_server: Server) -> None:
    """Novelty measured: the start of the reference sequence, in order, through the tool, with
    the real model (the whole sequence runs in process in test_reference.py)."""
    cases = SEQUENCE[:30]

    async def go() -> list[Any]:
        async with mcp_client(onnx_server) as client:
            return [await client.call_tool("kp_score_trace", c["trace"]) for c in cases]

    results = asyncio.run(go())
    for case, result in zip(cases, results, strict=True):
        answer = result.structured_content
        assert answer["score"] == pytest.approx(case["expected_score"], abs=SCORE_TOLERANCE)
        assert answer["novelty"]["cache_size"] == case["cache_size_before"]
    measured = [r for r in results if r.structured_content["novelty"]["measured"]]
    assert measured
    ids = [c["trace"]["id"] for c in cases]
    for r in measured:
        novelty = r.structured_content["novelty"]
        nearest = novelty["nearest"]
        assert nearest["trace_id"] in ids
        cosine = f"{nearest['cosine']:.4f}"
        said = f"; nearest earlier trace {nearest['trace_id']} (cosine {cosine})"
        assert text_of(r).endswith(said)
    stats = httpx.get(
        f"{onnx_server.url}/cache", headers={"authorization": f"Bearer {onnx_server.token}"}
    ).json()
    assert stats["size"] == len(cases)


@PROTOCOLS
def test_a_batch_is_scored_in_order_as_over_rest(server: Server, mode: str, version: str) -> None:
    traces = [c["trace"] for c in NO_EMBEDDER[:12]]
    result = call(server, "kp_score_traces", {"traces": traces, "dry_run": True}, mode)
    assert not result.is_error
    rest = httpx.post(f"{server.url}/evaluate/batch?dry_run=true", json={"traces": traces}).json()
    got = [(r["trace_id"], r["score"]) for r in result.structured_content["results"]]
    assert got == [(r["trace_id"], r["score"]) for r in rest["results"]]
    lines = text_of(result).splitlines()
    assert len(lines) == len(traces)
    assert lines[0].startswith(f"{traces[0]['id']}: score ")


def test_the_summary_line_says_score_verdict_and_novelty(server: Server) -> None:
    below = call(server, "kp_score_trace", make_trace())
    assert text_of(below) == (
        "score 0.57625 is below the 0.75 sharing threshold; novelty not measured "
        "(embedder_unavailable)"
    )
    # Weighted sum 0.7625 (steps with three distinct tools) under the default weights.
    steps = [
        {"step_id": i, "type": "tool_call", "content": f"call {name}", "tool": {"name": name}}
        for i, name in enumerate(["search", "read", "write"])
    ]
    unknown = call(server, "kp_score_trace", {**make_trace(domain="code-review"), "dry_run": True})
    assert text_of(unknown) == (
        "score 0.57625 is below the 0.75 sharing threshold; task_domain not recognised, "
        "scored with the default weights; novelty not measured (embedder_unavailable)"
    )
    assert unknown.structured_content["profile"] == {"name": "default", "domain_recognised": False}
    meets = call(server, "kp_score_trace", {**make_trace(steps=steps), "dry_run": True})
    score = meets.structured_content["score"]
    verdict = "meets" if score >= 0.75 else "is below"
    assert text_of(meets).startswith(f"score {score:.6g} {verdict} the 0.75 sharing threshold")


@pytest.mark.parametrize(
    ("tool", "arguments", "field"),
    [
        ("kp_score_trace", {**make_trace(), "steps": [{"step_id": 0, "type": "daydream"}]},
         "steps.0.type"),
        ("kp_score_trace", {k: v for k, v in make_trace().items() if k != "metadata"}, "metadata"),
        ("kp_score_trace", {**make_trace(), "source_skill": None}, "source_skill"),
        ("kp_score_trace", {**make_trace(), "dry_run": "yes"}, "dry_run"),
        ("kp_score_traces", {"traces": []}, "traces"),
        ("kp_score_traces", {"traces": [make_trace(), {"id": "kp:trace:x"}]}, "traces.1.metadata"),
    ],
)  # fmt: skip
def test_a_bad_trace_is_a_tool_error_naming_the_field(
    server: Server, tool: str, arguments: dict[str, Any], field: str
) -> None:
    result = call(server, tool, arguments)
    assert result.is_error
    assert result.structured_content is None
    text = text_of(result)
    assert text.startswith("invalid arguments, nothing was scored: ")
    assert f" {field}: " in text
    assert "Review PR" not in text  # the input is not echoed


def test_an_unknown_tool_is_a_protocol_error(server: Server) -> None:
    async def go() -> str:
        async with mcp_client(server) as client:
            try:
                await client.call_tool("kp_nothing", {})
            except MCPError as exc:
                return f"{exc.code} {exc.message}"
        return "no error"

    assert asyncio.run(go()) == "-32602 unknown tool: kp_nothing"


# In process: raw JSON-RPC on POST /mcp (the stateless server needs no initialize).

HEADERS = {"accept": "application/json, text/event-stream", "mcp-protocol-version": "2025-11-25"}


def rpc_body(tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    params = {"name": tool, "arguments": arguments}
    return {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params}


def rpc(client: TestClient, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    r = client.post("/mcp", json=rpc_body(tool, arguments), headers=HEADERS)
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()["result"]
    return result


def test_the_size_limits_are_the_rest_apis(make_client: ClientFactory) -> None:
    client = make_client(embedder="none", max_steps=2, max_batch=2)
    steps = [{"step_id": i, "type": "thought", "content": "x"} for i in range(3)]
    result = rpc(client, "kp_score_trace", make_trace(steps=steps))
    assert result["isError"] is True
    assert "steps: at most 2 steps per trace (KP_MAX_STEPS), got 3" in result["content"][0]["text"]
    result = rpc(client, "kp_score_traces", {"traces": [make_trace()] * 3})
    assert (
        "traces: at most 2 traces per batch (KP_MAX_BATCH), got 3" in (result["content"][0]["text"])
    )
    rest = client.post("/evaluate", json=make_trace(steps=steps))
    assert rest.status_code == 422
    assert rest.json()["detail"][0]["loc"] == ["body", "steps"]


def test_a_huge_key_in_a_refusal_is_cut_as_over_rest(make_client: ClientFactory) -> None:
    """A location repeats a key of the caller's JSON; the tool error cuts it as the REST
    answer does, rather than echoing a body's worth of it."""
    client = make_client(embedder="none")
    trace = make_trace()
    trace["steps"][0]["input"] = {"k" * 200_000: 1}
    for tool in ("kp_score_trace", "kp_check_contribution"):
        result = rpc(client, tool, trace)
        assert result["isError"] is True
        text = result["content"][0]["text"]
        assert text.startswith("invalid arguments, nothing was scored: steps.0.input.kkk")
        assert len(text) < 1_000
    rest = client.post("/evaluate", json=trace)
    assert rest.status_code == 422
    assert len(rest.json()["detail"][0]["loc"][-1]) <= 256


def test_an_overload_is_a_tool_error_saying_to_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past KP_EMBED_QUEUE_LIMIT texts: turned away at once, as by the 503, counted, and
    nothing of it is added."""
    traces = [make_trace(objective=f"overload {i}", trace_id=f"kp:trace:o-{i}") for i in range(3)]

    async def scenario() -> None:
        app = create_app(Settings(embedder_preload=True, embed_queue_limit=2))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://kp") as client:
                embeddings = app.state.service.runtime.embeddings
                gate = hold_runs(monkeypatch, embeddings)
                queued = [asyncio.create_task(client.post("/evaluate", json=t)) for t in traces[:2]]
                await until(lambda: embeddings.scheduler.queue_depth == 2)
                body = rpc_body("kp_score_trace", traces[2])
                r = await client.post("/mcp", json=body, headers=HEADERS)
                gate.set()
                assert [q.status_code for q in await asyncio.gather(*queued)] == [200, 200]
                result = r.json()["result"]
                assert result["isError"] is True
                text = result["content"][0]["text"]
                assert text.startswith("overloaded, nothing was scored; retry in a second: ")
                assert "KP_EMBED_QUEUE_LIMIT" in text
                metrics = (await client.get("/metrics")).text
                assert 'kp_overloaded_total{reason="queue_limit"} 1.0' in metrics
                assert (await client.get("/cache")).json()["size"] == 2
                # Once the queue has drained, the same trace is scored.
                r = await client.post("/mcp", json=body, headers=HEADERS)
                assert r.json()["result"]["structuredContent"]["novelty"]["cache_size"] == 2

    asyncio.run(scenario())


def test_requests_are_counted_by_transport(make_client: ClientFactory) -> None:
    client = make_client(embedder="none")
    assert client.post("/evaluate", json=make_trace()).status_code == 200
    for _ in range(2):
        assert not rpc(client, "kp_score_trace", make_trace()).get("isError")
    assert not rpc(client, "kp_score_traces", {"traces": [make_trace()]}).get("isError")
    metrics = client.get("/metrics").text
    assert 'kp_scoring_requests_total{kind="one",transport="rest"} 1.0' in metrics
    assert 'kp_scoring_requests_total{kind="one",transport="mcp"} 2.0' in metrics
    assert 'kp_scoring_requests_total{kind="batch",transport="mcp"} 1.0' in metrics
    assert 'kp_evaluations_total{profile="default"} 4.0' in metrics
    assert 'kp_http_requests_total{method="POST",route="/mcp",status="200"} 3.0' in metrics


def test_structured_content_is_json_the_rest_api_would_send(make_client: ClientFactory) -> None:
    client = make_client(embedder="none")
    result = rpc(client, "kp_score_trace", {**make_trace(), "dry_run": True})
    rest = client.post("/evaluate?dry_run=true", json=make_trace()).json()
    assert json.loads(json.dumps(result["structuredContent"])) | {"elapsed_ms": 0} == rest | {
        "elapsed_ms": 0
    }


def test_only_post_is_served_and_bad_json_rpc_is_a_400(make_client: ClientFactory) -> None:
    """Stateless: no session to DELETE, no server stream to GET (it would only hold a
    connection open); a body that is not JSON-RPC gets the SDK's JSON-RPC error."""
    client = make_client(embedder="none")
    for method in ("GET", "DELETE"):
        r = client.request(method, "/mcp", headers=HEADERS)
        assert r.status_code == 405
        assert r.headers["allow"] == "POST"
    r = client.post("/mcp", content=b"{not json", headers=HEADERS | JSON)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == -32700
    assert client.post("/evaluate", json=make_trace()).status_code == 200  # nothing broke


JSON = {"content-type": "application/json"}


def test_an_unexpected_error_is_an_internal_error_without_internals(
    make_client: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = make_client(embedder="none")
    services = client.app.state.service.runtime  # type: ignore[attr-defined]

    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("secret internals")

    monkeypatch.setattr(services.evaluator, "evaluate", broken)
    r = client.post("/mcp", json=rpc_body("kp_score_trace", make_trace()), headers=HEADERS)
    assert r.status_code == 200
    assert r.json()["error"] == {"code": -32603, "message": "internal error"}
    assert "secret" not in r.text


@pytest.mark.slow  # a fresh interpreter imports the app and the SDK: seconds
def test_the_mcp_sdk_loads_on_the_first_mcp_request_not_at_start() -> None:
    """A start does not pay for the MCP SDK's import (the cold start); the first /mcp request
    loads it, and REST answers before and after. In a fresh interpreter: this one has it."""
    code = f"""
import sys
from fastapi.testclient import TestClient
from app.core.config import Settings
from app.main import create_app
from tests.factories import make_trace

with TestClient(create_app(Settings(embedder="none"))) as client:
    assert client.post("/evaluate", json=make_trace()).status_code == 200
    assert "mcp" not in sys.modules, "the MCP SDK was imported at start"
    body = {{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}}
    r = client.post("/mcp", json=body, headers={HEADERS!r})
    assert r.status_code == 200, r.text
    names = [t["name"] for t in r.json()["result"]["tools"]]
    assert names == ["kp_score_trace", "kp_score_traces", "kp_check_contribution"], names
    assert "mcp" in sys.modules
    assert client.post("/evaluate", json=make_trace()).status_code == 200
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


@pytest.mark.slow  # a fresh interpreter starts the app with the model: seconds
def test_preload_starts_the_mcp_server_with_the_service() -> None:
    code = """
import sys
from fastapi.testclient import TestClient
from app.core.config import Settings
from app.main import create_app

with TestClient(create_app(Settings(embedder="none", embedder_preload=True))):
    assert "app.api.mcp_server" in sys.modules
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr


def test_an_mcp_server_that_cannot_load_is_a_503_and_rest_serves_on(
    make_client: ClientFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from app.api import mcp as mcp_endpoint

    monkeypatch.setattr(mcp_endpoint, "_SERVER_MODULE", "app.api.no_such_mcp_server")
    client = make_client(embedder="none")
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    r = client.post("/mcp", json=body, headers=HEADERS)
    assert r.status_code == 503
    assert r.json() == {"detail": "the MCP server could not start"}
    assert "mcp: the MCP server could not start" in caplog.text
    ready = client.get("/readyz").json()
    assert any(w.startswith("mcp_unavailable: ") for w in ready["warnings"]), ready
    assert client.post("/evaluate", json=make_trace()).status_code == 200
