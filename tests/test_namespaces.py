"""Namespaces through the API (docs/api.md, namespaces), with the real model: each namespace's
memory is its own, bound keys keep to theirs, bad names and the namespace limit change nothing,
/cache and export/import act per namespace, idempotency keys and metrics are per namespace, and
the clients, the command line and MCP carry the namespace."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from app.core.config import Settings
from app.main import create_app
from kp_scoring import AsyncKpScoringClient, Forbidden, KpScoringClient
from kp_scoring.cli import cli
from tests.conftest import ClientFactory
from tests.factories import make_trace
from tests.keys import AGENT_A, OPS, bearer, entry, write_keys
from tests.server import TOKEN, Server, running_server

NET_A_AGENT = "kp-net-a-agent-2f6c0d81"
NET_A_OPS = "kp-net-a-ops-94b7e3a5"
MCP_HEADERS = {
    "accept": "application/json, text/event-stream",
    "mcp-protocol-version": "2025-11-25",
}
TRACE = make_trace(objective="Audit the billing service for SQL injection")
OTHER = make_trace(objective="Plan a week of vegetarian dinners", trace_id="kp:trace:test-dinners")
BAD_NAMES: list[str | bytes] = ["", "net/a", "{net-a}", "net a", "x" * 65, "né".encode()]


def keys_file(directory: Path) -> Path:
    return write_keys(
        directory / "keys.json",
        [
            entry("agent-a", AGENT_A, ["evaluate"]),
            {**entry("net-a-agent", NET_A_AGENT, ["evaluate"]), "namespace": "net-a"},
            {**entry("net-a-ops", NET_A_OPS, ["admin"]), "namespace": "net-a"},
            entry("ops", OPS, ["admin"]),
        ],
    )


def ns(name: str, **more: str) -> dict[str, str]:
    return {"KP-Namespace": name, **more}


def novelty(client: TestClient, trace: dict[str, Any], **headers: str) -> dict[str, Any]:
    r = client.post("/evaluate", json=trace, headers=headers)
    assert r.status_code == 200, r.text
    found: dict[str, Any] = r.json()["novelty"]
    return found


def sizes(client: TestClient, **auth: str) -> dict[str, int]:
    """Every namespace's size, as an admin sees them."""
    listed = client.get("/cache/namespaces", headers=auth)
    assert listed.status_code == 200, listed.text
    return {
        name: client.get("/cache", headers=ns(name, **auth)).json()["size"]
        for name in listed.json()["namespaces"]
    }


def test_the_same_trace_is_novel_in_each_namespace(client: TestClient) -> None:
    assert novelty(client, TRACE, **ns("net-a"))["reason"] == "cache_empty"
    assert novelty(client, TRACE, **ns("net-b"))["reason"] == "cache_empty"
    again = novelty(client, TRACE, **ns("net-a"))
    assert again["measured"] is True
    assert again["cache_size"] == 1
    assert again["max_cosine"] == pytest.approx(1.0, abs=1e-5)
    assert again["nearest"]["trace_id"] == TRACE["id"]
    # Without the header: `default`, which holds nothing yet.
    assert novelty(client, TRACE)["reason"] == "cache_empty"
    assert sizes(client) == {"default": 1, "net-a": 2, "net-b": 1}
    listed = client.get("/cache/namespaces").json()
    assert listed == {"namespaces": ["default", "net-a", "net-b"], "limit": 1000}


def test_a_batch_is_compared_within_its_namespace(client: TestClient) -> None:
    novelty(client, OTHER, **ns("net-a"))
    r = client.post("/evaluate/batch", json={"traces": [TRACE, TRACE]}, headers=ns("net-b"))
    assert r.status_code == 200, r.text
    first, second = (x["novelty"] for x in r.json()["results"])
    assert first["reason"] == "cache_empty"  # net-a's trace is not seen
    assert second["cache_size"] == 1
    assert second["max_cosine"] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_bad_name_is_a_422_naming_the_header_and_changes_nothing(
    client: TestClient, name: str | bytes
) -> None:
    novelty(client, TRACE, **ns("net-a"))
    before = sizes(client)
    headers: dict[str, Any] = {"KP-Namespace": name}
    calls = [
        client.post("/evaluate", json=TRACE, headers=headers),
        client.post("/evaluate/batch", json={"traces": [TRACE]}, headers=headers),
        client.get("/cache", headers=headers),
        client.delete("/cache", headers=headers),
        client.get("/cache/export", headers=headers),
        client.post(
            "/cache/import",
            content=client.get("/cache/export", headers=ns("net-a")).content,
            headers={**headers, "content-type": "application/x-ndjson"},
        ),
    ]
    for r in calls:
        assert r.status_code == 422, (r.request.method, r.request.url, r.text)
        assert r.json() == {
            "detail": [
                {
                    "loc": ["header", "kp-namespace"],
                    "msg": "KP-Namespace must be 1 to 64 characters of letters, digits, "
                    "'.', '_' and '-'",
                    "type": "namespace_invalid",
                }
            ]
        }
    assert sizes(client) == before


def test_the_cache_routes_act_on_the_request_s_namespace(client: TestClient) -> None:
    novelty(client, TRACE, **ns("net-a"))
    novelty(client, OTHER, **ns("net-a"))
    novelty(client, OTHER, **ns("net-b"))
    stats = client.get("/cache", headers=ns("net-a")).json()
    assert (stats["namespace"], stats["size"], stats["adds_total"]) == ("net-a", 2, 2)
    assert client.get("/cache").json()["namespace"] == "default"
    exported = client.get("/cache/export", headers=ns("net-a"))
    assert exported.status_code == 200
    lines = [json.loads(line) for line in exported.text.splitlines()]
    assert [line["trace_id"] for line in lines] == [TRACE["id"], OTHER["id"]]
    # Into a third namespace: it now finds net-a's traces, and net-b is as it was.
    imported = client.post(
        "/cache/import",
        content=exported.content,
        headers=ns("net-c", **{"content-type": "application/x-ndjson"}),
    )
    assert imported.status_code == 200, imported.text
    assert imported.json()["imported"] == 2
    found = novelty(client, TRACE, **ns("net-c"))
    assert found["nearest"]["trace_id"] == TRACE["id"]
    assert found["cache_size"] == 2
    assert sizes(client) == {"net-a": 2, "net-b": 1, "net-c": 3}
    # DELETE empties the one namespace.
    assert client.delete("/cache", headers=ns("net-a")).json() == {"cleared": 2}
    assert sizes(client) == {"net-b": 1, "net-c": 3}
    assert client.get("/cache/namespaces").json()["namespaces"] == ["net-b", "net-c"]


def test_past_the_limit_a_new_namespace_is_a_409_and_changes_nothing(
    make_client: ClientFactory,
) -> None:
    client = make_client(max_namespaces=2)
    novelty(client, TRACE, **ns("net-a"))
    novelty(client, TRACE, **ns("net-b"))
    export = client.get("/cache/export", headers=ns("net-a")).content
    refused = [
        client.post("/evaluate", json=OTHER, headers=ns("net-c")),
        client.post("/evaluate/batch", json={"traces": [OTHER]}, headers=ns("net-c")),
        client.post(
            "/cache/import",
            content=export,
            headers=ns("net-c", **{"content-type": "application/x-ndjson"}),
        ),
    ]
    for r in refused:
        assert r.status_code == 409, r.text
        (error,) = r.json()["detail"]
        assert error["loc"] == ["header", "kp-namespace"]
        assert error["type"] == "namespace_limit"
        assert "KP_MAX_NAMESPACES" in error["msg"]
    assert sizes(client) == {"net-a": 1, "net-b": 1}
    assert "kp_namespace_limit_refused_total 3.0" in client.get("/metrics").text
    # A dry run starts no namespace: it is scored; the namespaces already there go on.
    dry = client.post("/evaluate?dry_run=true", json=OTHER, headers=ns("net-c"))
    assert dry.status_code == 200
    assert novelty(client, OTHER, **ns("net-a"))["cache_size"] == 1
    # Emptying a namespace frees its place.
    client.delete("/cache", headers=ns("net-b"))
    assert novelty(client, OTHER, **ns("net-c"))["reason"] == "cache_empty"
    assert sizes(client) == {"net-a": 2, "net-c": 1}


def test_an_idempotency_key_is_one_request_per_namespace(client: TestClient) -> None:
    key = {"Idempotency-Key": "review-42"}
    first = client.post("/evaluate", json=TRACE, headers=ns("net-a", **key))
    other = client.post("/evaluate", json=TRACE, headers=ns("net-b", **key))
    replay = client.post("/evaluate", json=TRACE, headers=ns("net-a", **key))
    assert "idempotent-replayed" not in first.headers
    assert "idempotent-replayed" not in other.headers
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.content == first.content
    assert sizes(client) == {"net-a": 1, "net-b": 1}


@pytest.fixture
def keyed_client(make_client: ClientFactory, tmp_path: Path) -> TestClient:
    return make_client(api_keys_file=keys_file(tmp_path), admin_token=TOKEN)


def test_a_bound_key_uses_its_namespace_alone(keyed_client: TestClient) -> None:
    client = keyed_client
    agent, admin = bearer(NET_A_AGENT), bearer(NET_A_OPS)
    assert novelty(client, TRACE, **agent)["reason"] == "cache_empty"
    assert novelty(client, TRACE, **ns("net-a", **agent))["cache_size"] == 1
    everyone = bearer(TOKEN)
    assert sizes(client, **everyone) == {"net-a": 2}
    for r in [
        client.post("/evaluate", json=OTHER, headers=ns("net-b", **agent)),
        client.post("/evaluate", json=OTHER, headers=ns("default", **agent)),
        client.post("/evaluate/batch", json={"traces": [OTHER]}, headers=ns("net-b", **agent)),
        client.get("/cache", headers=ns("net-b", **admin)),
        client.delete("/cache", headers=ns("net-b", **admin)),
        client.get("/cache/export", headers=ns("net-b", **admin)),
    ]:
        assert r.status_code == 403, r.text
        (error,) = r.json()["detail"]
        assert error["loc"] == ["header", "kp-namespace"]
        assert error["type"] == "namespace_forbidden"
        assert "is bound to the namespace 'net-a'" in error["msg"]
    assert sizes(client, **everyone) == {"net-a": 2}
    # The bound admin key manages its namespace, and may not list the others.
    assert client.get("/cache", headers=admin).json()["namespace"] == "net-a"
    listing = client.get("/cache/namespaces", headers=admin)
    assert listing.status_code == 403
    assert listing.json()["detail"][0]["type"] == "namespace_forbidden"
    # Keys bound to no namespace name any.
    assert novelty(client, OTHER, **ns("net-b", **bearer(AGENT_A)))["reason"] == "cache_empty"
    assert client.get("/cache/namespaces", headers=bearer(OPS)).json()["namespaces"] == [
        "net-a",
        "net-b",
    ]
    metrics = client.get("/metrics").text
    assert 'kp_auth_refused_total{reason="namespace_forbidden"} 7.0' in metrics


def test_metrics_count_per_namespace_up_to_the_bound(make_client: ClientFactory) -> None:
    client = make_client(embedder="none", metrics_namespaces=2)
    for name in ["net-a", "net-b", "net-c", "net-d", "net-a"]:
        assert client.post("/evaluate", json=TRACE, headers=ns(name)).status_code == 200
    metrics = client.get("/metrics").text
    assert 'kp_namespace_evaluations_total{namespace="net-a"} 2.0' in metrics
    assert 'kp_namespace_evaluations_total{namespace="net-b"} 1.0' in metrics
    assert 'kp_namespace_evaluations_total{namespace="(other)"} 2.0' in metrics
    assert "net-c" not in metrics


# MCP: raw JSON-RPC on POST /mcp (the stateless server needs no initialize).


def mcp(
    client: TestClient, arguments: dict[str, Any], headers: dict[str, str] | None = None
) -> dict[str, Any]:
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "kp_score_trace", "arguments": arguments},
    }
    r = client.post("/mcp", json=body, headers={**MCP_HEADERS, **(headers or {})})
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()["result"]
    return result


def test_mcp_tools_take_the_namespace_as_an_argument_or_the_header(
    keyed_client: TestClient,
) -> None:
    client = keyed_client
    agent = bearer(AGENT_A)
    first = mcp(client, {**TRACE, "namespace": "net-a"}, agent)
    assert first["structuredContent"]["novelty"]["reason"] == "cache_empty"
    by_header = mcp(client, TRACE, ns("net-a", **agent))
    assert by_header["structuredContent"]["novelty"]["cache_size"] == 1
    elsewhere = mcp(client, TRACE, agent)  # default
    assert elsewhere["structuredContent"]["novelty"]["reason"] == "cache_empty"
    bad = mcp(client, {**TRACE, "namespace": "net/a"}, agent)
    assert bad["isError"] is True
    assert bad["content"][0]["text"] == (
        "invalid arguments, nothing was scored: namespace: must be 1 to 64 characters of "
        "letters, digits, '.', '_' and '-' (namespace_invalid)"
    )
    differ = mcp(client, {**TRACE, "namespace": "net-b"}, ns("net-a", **agent))
    assert differ["isError"] is True
    assert (
        "the argument 'net-b' and the KP-Namespace header 'net-a' differ"
        in (differ["content"][0]["text"])
    )
    bound = mcp(client, {**TRACE, "namespace": "net-b"}, bearer(NET_A_AGENT))
    assert bound["isError"] is True
    assert "bound to the namespace 'net-a'" in bound["content"][0]["text"]
    assert sizes(client, **bearer(TOKEN)) == {"default": 1, "net-a": 2}
    metrics = client.get("/metrics").text
    assert 'kp_auth_refused_total{reason="namespace_forbidden"} 1.0' in metrics


def test_the_mcp_tools_declare_the_namespace(client_no_embedder: TestClient) -> None:
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    tools = client_no_embedder.post("/mcp", json=body, headers=MCP_HEADERS).json()
    for tool in tools["result"]["tools"]:
        schema = tool["inputSchema"]["properties"]["namespace"]
        assert schema["pattern"] == "^[A-Za-z0-9._-]{1,64}$"


def test_the_async_client_sends_its_namespace() -> None:
    async def scenario() -> None:
        app = create_app(Settings())
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with AsyncKpScoringClient(
                "http://kp", namespace="net-a", transport=transport
            ) as kp:
                assert (await kp.evaluate(TRACE)).novelty.reason == "cache_empty"
                again = await kp.evaluate(TRACE, dry_run=True)
                assert again.novelty.cache_size == 1
                other = await kp.evaluate(TRACE, namespace="net-b")
                assert other.novelty.reason == "cache_empty"
                batch = await kp.evaluate_batch([OTHER], namespace="net-b")
                assert batch[0].novelty.cache_size == 1
                assert (await kp.cache_stats()).namespace == "net-a"
                assert (await kp.cache_stats(namespace="net-b")).size == 2
                assert await kp.cache_namespaces() == ["net-a", "net-b"]
                assert await kp.cache_reset(namespace="net-b") == 2
                assert await kp.cache_namespaces() == ["net-a"]

    asyncio.run(scenario())


# The blocking client and the command line, against a live server.


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    keys = keys_file(tmp_path_factory.mktemp("keys"))
    with running_server(embedder="onnx", api_keys_file=str(keys)) as server:
        yield server


@pytest.mark.server
def test_the_client_and_the_command_line_carry_the_namespace(
    live: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with KpScoringClient(live.url, api_key=AGENT_A, namespace="cli-a") as kp:
        assert kp.evaluate(TRACE).novelty.reason == "cache_empty"
        assert kp.evaluate(TRACE, namespace="cli-b").novelty.reason == "cache_empty"
        assert kp.evaluate_batch([TRACE], dry_run=True)[0].novelty.cache_size == 1
    with KpScoringClient(live.url, api_key=NET_A_AGENT) as bound:
        with pytest.raises(Forbidden) as refused:
            bound.evaluate(TRACE, namespace="cli-a")
        assert refused.value.errors[0].type == "namespace_forbidden"
    with KpScoringClient(live.url, admin_token=TOKEN, namespace="cli-a") as admin:
        assert admin.cache_stats().size == 1
        assert admin.cache_namespaces() == ["cli-a", "cli-b"]

    path = tmp_path / "trace.json"
    path.write_text(json.dumps(TRACE), encoding="utf-8")
    runner = CliRunner()
    env = {"KP_URL": live.url, "KP_API_KEY": AGENT_A}
    ran = runner.invoke(cli, ["evaluate", str(path), "--json", "--namespace", "cli-c"], env=env)
    assert ran.exit_code in (0, 1), ran.output
    assert json.loads(ran.stdout)["novelty"]["reason"] == "cache_empty"
    ran = runner.invoke(
        cli, ["evaluate", str(path), "--json"], env={**env, "KP_NAMESPACE": "cli-c"}
    )
    assert json.loads(ran.stdout)["novelty"]["cache_size"] == 1
    admin_env = {"KP_URL": live.url, "KP_ADMIN_TOKEN": TOKEN}
    ran = runner.invoke(cli, ["cache", "namespaces"], env=admin_env)
    assert ran.exit_code == 0, ran.output
    assert ran.stdout.split() == ["cli-a", "cli-b", "cli-c"]
    ran = runner.invoke(cli, ["cache", "stats", "--json", "--namespace", "cli-c"], env=admin_env)
    assert json.loads(ran.stdout)["size"] == 2
    ran = runner.invoke(cli, ["cache", "reset", "--namespace", "cli-c"], env=admin_env)
    assert ran.stdout.strip() == "cleared 2 cached vectors"
    ran = runner.invoke(cli, ["cache", "namespaces"], env=admin_env)
    assert ran.stdout.split() == ["cli-a", "cli-b"]


def test_the_access_log_names_the_namespace(
    client_no_embedder: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="app.access"):
        client_no_embedder.post("/evaluate", json=TRACE, headers=ns("net-a"))
        client_no_embedder.post("/evaluate", json=TRACE)
    lines = [r for r in caplog.records if r.getMessage() == "request"]
    assert [getattr(r, "namespace", None) for r in lines] == ["net-a", "default"]
