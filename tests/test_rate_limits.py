"""Per-key rate limits against live servers with the real model: past its bucket a key gets 429
with Retry-After, nothing is scored or added, other keys are served; across two replicas on one
redis-server the bucket is one."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.factories import make_trace
from tests.keys import (
    AGENT_A,
    AGENT_B,
    OPS,
    SLOW,
    adds,
    bearer,
    entry,
    keyed_env,
    standard_keys,
    write_keys,
)
from tests.server import LiveServer, RedisServer, free_port

pytestmark = [pytest.mark.server, pytest.mark.redis]

PAIR = "kp-pair-8d0c55e1f2"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    directory = tmp_path_factory.mktemp("rate")
    server = LiveServer(keyed_env(standard_keys(directory / "keys.json")), directory / "server.log")
    yield server
    server.stop()


def test_a_key_over_its_rate_gets_429_and_adds_nothing(live: LiveServer) -> None:
    before = adds(live)
    first = live.client.post(
        "/evaluate", json=make_trace(trace_id="kp:trace:r1"), headers=bearer(SLOW)
    )
    assert first.status_code == 200, first.text
    refused = [
        live.client.post(
            "/evaluate", json=make_trace(trace_id=f"kp:trace:r{i}"), headers=bearer(SLOW)
        )
        for i in range(2, 5)
    ]
    for r in refused:
        assert r.status_code == 429, r.text
        assert 1 <= int(r.headers["retry-after"]) <= 60  # one request a minute
        assert "'slow'" in r.json()["detail"][0]["msg"]
    other = live.client.post(
        "/evaluate", json=make_trace(trace_id="kp:trace:b"), headers=bearer(AGENT_B)
    )
    assert other.status_code == 200, other.text
    assert adds(live) == before + 2  # the first and the other key's; none of the 429s
    metrics = live.client.get("/metrics").text
    assert re.search(
        r'kp_api_key_requests_total\{key="slow",outcome="rate_limited"\} 3\.0', metrics
    )
    assert re.search(r'kp_api_key_requests_total\{key="slow",outcome="admitted"\} 1\.0', metrics)
    assert 'kp_api_key_requests_total{key="agent-b",outcome="admitted"}' in metrics


def test_keys_without_a_rate_are_counted_and_never_limited(live: LiveServer) -> None:
    for i in range(3):
        r = live.client.post(
            "/evaluate",
            json=make_trace(trace_id=f"kp:trace:u{i}"),
            headers=bearer(AGENT_A),
            params={"dry_run": "true"},
        )
        assert r.status_code == 200
    metrics = live.client.get("/metrics").text
    assert re.search(r'kp_api_key_requests_total\{key="agent-a",outcome="admitted"\} 3\.0', metrics)


def test_a_refused_request_is_not_read(live: LiveServer) -> None:
    """Past its rate, a request with a body that is not even JSON is still a 429, not a 422
    or a 415: the limit comes before the body is read."""
    for body, content_type in ((b"{not json", "application/json"), (b"x", "text/plain")):
        r = live.client.post(
            "/evaluate", content=body, headers={**bearer(SLOW), "content-type": content_type}
        )
        assert r.status_code == 429, r.text


def test_a_whole_minute_may_come_at_once(tmp_path: Path) -> None:
    keys = write_keys(tmp_path / "keys.json", [entry("burst", PAIR, ["evaluate"], rate=5)])
    server = LiveServer(keyed_env(keys, KP_EMBEDDER="none"), tmp_path / "server.log")
    try:
        with ThreadPoolExecutor(8) as pool:
            codes = list(
                pool.map(
                    lambda i: (
                        server.client.post(
                            "/evaluate",
                            json=make_trace(trace_id=f"kp:trace:{i}"),
                            headers=bearer(PAIR),
                        ).status_code
                    ),
                    range(8),
                )
            )
    finally:
        server.stop()
    assert sorted(codes) == [200] * 5 + [429] * 3


def test_the_limit_holds_across_two_replicas_on_one_redis(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    keys = write_keys(
        tmp_path / "keys.json",
        [entry("pair", PAIR, ["evaluate"], rate=2), entry("ops", OPS, ["admin"])],
    )
    shared = keyed_env(
        keys,
        KP_REDIS_URL=redis_server.url,
        KP_REDIS_PREFIX=redis_prefix,
        KP_REDIS_TIMEOUT_MS="10000",
    )
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(lambda i: LiveServer(shared, tmp_path / f"replica-{i}.log"), range(2))
    try:
        answers = [
            replica.client.post(
                "/evaluate", json=make_trace(trace_id=f"kp:trace:p{i}"), headers=bearer(PAIR)
            )
            for i, replica in enumerate((a, b, a, b))
        ]
        codes = [r.status_code for r in answers]
        assert codes == [200, 200, 429, 429]
        assert adds(a) == adds(b) == 2
        with redis_server.client() as client:
            assert client.exists(f"{redis_prefix}ratelimit:pair") == 1
    finally:
        a.stop()
        b.stop()
    # Retry-After is honest: a bucket of 2 a minute refills a token within 30 s.
    assert 1 <= int(answers[-1].headers["retry-after"]) <= 30


def test_without_redis_limits_go_unchecked_visibly_and_idempotency_is_a_503(
    tmp_path: Path,
) -> None:
    """Redis away: a rate limit lets requests through, counted and logged (refusing every agent
    would be worse); an Idempotency-Key cannot be honoured, so that request is a 503 and
    nothing is scored."""
    keys = standard_keys(tmp_path / "keys.json")
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    server = LiveServer(
        keyed_env(keys, KP_EMBEDDER="none", KP_REDIS_URL=nowhere, KP_LOG_LEVEL="info"),
        tmp_path / "server.log",
    )
    try:
        for _ in range(2):  # one a minute: the second would be refused with Redis there
            r = server.client.post("/evaluate", json=make_trace(), headers=bearer(SLOW))
            assert r.status_code == 200, r.text
        metrics = server.client.get("/metrics").text
        assert "kp_rate_limit_unavailable_total 2.0" in metrics
        r = server.client.post(
            "/evaluate", json=make_trace(), headers={**bearer(AGENT_B), "Idempotency-Key": "k1"}
        )
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1"
        assert r.json()["detail"][0]["type"] == "idempotency_unavailable"
        assert 'kp_evaluations_total{profile="default"} 2.0' in server.client.get("/metrics").text
    finally:
        server.stop()
    assert "rate limit not checked: Redis unavailable" in server.log_path.read_text()


def test_the_bucket_refills_at_its_rate() -> None:
    """The in-process bucket on a clock the test moves: a minute's worth at once, then one
    request per 1/rate of a minute, and never more than a minute's worth saved up."""
    import asyncio

    from app.guards import rate_limit

    now = [1000.0]
    limiter = rate_limit.InProcessRateLimiter(clock=lambda: now[0])

    def take() -> float:
        return asyncio.run(limiter.take("k", 60))

    assert [take() for _ in range(60)] == [0.0] * 60
    assert take() == pytest.approx(1.0)  # one token a second
    now[0] += 0.5
    assert take() == pytest.approx(0.5)
    now[0] += 0.5
    assert take() == 0.0
    now[0] += 3600  # an hour idle: the bucket is full, not fuller
    assert [take() for _ in range(60)] == [0.0] * 60
    assert take() > 0
    assert rate_limit.retry_after(0.2) == 1
    assert rate_limit.retry_after(1.5) == 2


@pytest.mark.parametrize("shared", [False, True])
def test_a_batch_costs_one_token_per_trace(
    tmp_path: Path, redis_server: RedisServer, shared: bool
) -> None:
    keys = write_keys(
        tmp_path / "keys.json",
        [
            entry("batcher", PAIR, ["evaluate"], rate=10),
            entry("agent", AGENT_B, ["evaluate"], rate=4),
        ],
    )
    more = (
        {"KP_REDIS_URL": redis_server.url, "KP_REDIS_PREFIX": f"kp-batch-{tmp_path.name}:"}
        if shared
        else {}
    )
    server = LiveServer(keyed_env(keys, KP_EMBEDDER="none", **more), tmp_path / "server.log")

    def batch(n: int, start: int) -> Any:
        traces = [make_trace(trace_id=f"kp:trace:{start + i}") for i in range(n)]
        return server.client.post("/evaluate/batch", json={"traces": traces}, headers=bearer(PAIR))

    def mcp_batch(n: int) -> Any:
        call = {"name": "kp_score_traces", "arguments": {"traces": [make_trace()] * n}}
        rpc = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": call}
        headers = bearer(AGENT_B) | {
            "accept": "application/json, text/event-stream",
            "mcp-protocol-version": "2025-11-25",
        }
        return server.client.post("/mcp", json=rpc, headers=headers).json()["result"]

    try:
        # A refused batch spends nothing, its first token (taken before the body) included.
        too_big = batch(11, 0)  # more than the bucket ever holds: never retry it as it is
        assert too_big.status_code == 422, too_big.text
        assert too_big.json()["detail"][0]["loc"] == ["body", "traces"]
        assert too_big.json()["detail"][0]["type"] == "batch_over_rate"
        assert batch(6, 0).status_code == 200  # 10 - 6 = 4 left
        over = batch(5, 10)
        assert over.status_code == 429, over.text
        assert int(over.headers["retry-after"]) >= 1
        assert "a batch of 5 costs 5" in over.json()["detail"][0]["msg"]
        assert batch(4, 20).status_code == 200  # still 4: exactly
        assert mcp_batch(3)["isError"] is False  # 4 - 3 = 1 left
        refused = mcp_batch(2)  # not enough: refused, and spends nothing
        assert refused["isError"] is True
        assert "over its rate of 4 traces a minute" in refused["content"][0]["text"]
        assert mcp_batch(1)["isError"] is False  # the one token left is still there
    finally:
        server.stop()
