"""/mcp behind the same keys, scopes, rate limits and signatures as the REST API (issue 20),
through the official MCP Python client (its HTTP client carrying the Bearer key) and raw
JSON-RPC, against live servers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from kp_scoring.signatures import verify
from tests.factories import make_trace
from tests.keys import AGENT_A, OPS, SLOW, bearer
from tests.server import Server, running_server
from tests.test_mcp import HEADERS, rpc_body
from tests.test_signatures import pem

pytestmark = pytest.mark.server


def score_with(server: Server, key: str | None) -> Any:
    """kp_score_trace through the official client, its requests carrying `key`."""

    async def go() -> Any:
        headers = bearer(key) if key is not None else None
        async with (
            create_mcp_http_client(headers=headers) as http,
            Client(streamable_http_client(f"{server.url}/mcp", http_client=http)) as client,
        ):
            return await client.call_tool("kp_score_trace", {**make_trace(), "dry_run": True})

    return asyncio.run(go())


def post(server: Server, headers: dict[str, str]) -> httpx.Response:
    body = rpc_body("kp_score_trace", {**make_trace(), "dry_run": True})
    return httpx.post(f"{server.url}/mcp", json=body, headers=HEADERS | headers)


def test_an_evaluate_key_scores_through_the_official_client(keyed: Server) -> None:
    result = score_with(keyed, AGENT_A)
    assert not result.is_error
    assert result.structured_content["score"] == 0.57625


def test_no_key_is_refused(keyed: Server) -> None:
    r = post(keyed, {})
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == 'Bearer realm="kp-scoring"'
    assert r.json()["detail"][0]["loc"] == ["header", "authorization"]
    # The official client fails (its task group wraps the SDK's error), and scores nothing.
    with pytest.raises(BaseExceptionGroup) as caught:
        score_with(keyed, None)
    assert caught.group_contains(MCPError, match="error response", depth=2)


def test_an_unknown_key_and_a_key_without_the_scope_are_refused(keyed: Server) -> None:
    assert post(keyed, bearer("kp-not-a-key")).status_code == 401
    r = post(keyed, bearer(OPS))  # admin only
    assert r.status_code == 403
    assert "lacks the scope 'evaluate'" in r.json()["detail"][0]["msg"]


def test_the_keys_rate_limit_counts_mcp_calls(keyed: Server) -> None:
    """`slow` may make one request a minute, REST or MCP alike."""
    assert post(keyed, bearer(SLOW)).status_code == 200
    refused = post(keyed, bearer(SLOW))
    assert refused.status_code == 429
    assert int(refused.headers["retry-after"]) >= 1
    rest = httpx.post(f"{keyed.url}/evaluate?dry_run=true", json=make_trace(), headers=bearer(SLOW))
    assert rest.status_code == 429


@pytest.fixture(scope="module")
def signing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    key = tmp_path_factory.mktemp("signing") / "current.pem"
    key.write_bytes(pem(ed25519.Ed25519PrivateKey.generate()))
    with running_server(signing_key_file=str(key)) as server:
        yield server


def test_mcp_answers_are_signed_as_the_rest_answers(signing: Server) -> None:
    jwks = httpx.get(f"{signing.url}/.well-known/jwks.json").json()
    trace = make_trace()
    r = httpx.post(f"{signing.url}/mcp", json=rpc_body("kp_score_trace", trace), headers=HEADERS)
    answer = r.json()["result"]["structuredContent"]
    claims = verify(answer["signature"], trace, jwks, answer=answer)
    assert claims["answer"]["score"] == answer["score"] == 0.57625
    traces = [make_trace(trace_id="kp:trace:s-1"), make_trace(trace_id="kp:trace:s-2")]
    body = rpc_body("kp_score_traces", {"traces": traces, "dry_run": True})
    results = httpx.post(f"{signing.url}/mcp", json=body, headers=HEADERS).json()["result"]
    for sent, got in zip(traces, results["structuredContent"]["results"], strict=True):
        claims = verify(got["signature"], sent, jwks, answer=got)
        assert claims["answer"]["trace_id"] == sent["id"]


def test_a_trace_past_i_json_is_signed(signing: Server) -> None:
    """An integer of 2**53 or more is digested as JavaScript reads it (a double): signed, as
    over REST."""
    trace = make_trace()
    trace["task"]["input_schema"] = {"big": 2**60}
    r = httpx.post(f"{signing.url}/mcp", json=rpc_body("kp_score_trace", trace), headers=HEADERS)
    result = r.json()["result"]
    assert not result.get("isError"), result
    jwks = httpx.get(f"{signing.url}/.well-known/jwks.json").json()
    answer = result["structuredContent"]
    assert verify(answer["signature"], trace, jwks, answer=answer)
