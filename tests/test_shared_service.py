"""Three replicas with the real model on one Redis 8 (KP_REDIS_URL): one novelty memory for
all, one order, one reset; Redis killed with kill -9 under load and restarted."""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.factories import TOPICS, make_trace, step
from tests.server import TOKEN, LiveServer, RedisServer
from tests.test_reference import SCORE_TOLERANCE, SEQUENCE

pytestmark = [pytest.mark.server, pytest.mark.redis, pytest.mark.slow]

PREFIX = "kp-replicas:"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def replicas(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[LiveServer]]:
    logs = tmp_path_factory.mktemp("replicas")
    env = {
        "KP_EMBEDDER": "onnx",
        "KP_EMBEDDER_PRELOAD": "true",
        # Three model processes on a small machine: one thread each, else onnxruntime's idle
        # threads spin on the cores the busy replica needs (the sequence took twice as long).
        "KP_EMBEDDER_WORKERS": "1",
        "KP_EMBEDDER_THREADS": "1",
        "KP_LOG_LEVEL": "warning",
        "KP_ADMIN_TOKEN": TOKEN,
        "KP_REDIS_URL": redis_server.url,
        "KP_REDIS_PREFIX": PREFIX,
        # These tests check order and content: a busy test machine must not time them out.
        "KP_REDIS_TIMEOUT_MS": "10000",
        "KP_EMBED_MAX_WAIT_MS": "60000",
    }
    with ThreadPoolExecutor(3) as pool:
        servers = list(pool.map(lambda i: LiveServer(env, logs / f"replica-{i}.log"), range(3)))
    yield servers
    for s in servers:
        s.stop()


def full_log(server: LiveServer) -> str:
    return server.log_path.read_text(errors="replace")


def reset(replicas: list[LiveServer]) -> None:
    r = replicas[-1].client.delete("/cache", headers=AUTH)
    assert r.status_code == 200, r.text


def shared_log(redis: RedisServer) -> list[str]:
    """Trace ids in the default namespace's memory in Redis, oldest first."""
    with redis.client() as client:
        first, stop = client.hmget(f"{PREFIX}{{default}}:meta", "first", "next")
        if first is None:
            return []
        keys = [f"{PREFIX}{{default}}:e:{seq}" for seq in range(int(first), int(stop))]
        return [t.decode() for t in (client.hget(key, "trace") for key in keys) if t]


def test_the_reference_sequence_round_robin_over_three_replicas(
    replicas: list[LiveServer], redis_server: RedisServer
) -> None:
    reset(replicas)
    for i, case in enumerate(SEQUENCE):
        r = replicas[i % 3].post("/evaluate", case["trace"])
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["score"] == pytest.approx(case["expected_score"], abs=SCORE_TOLERANCE), case[
            "name"
        ]
        assert body["novelty"]["cache_size"] == case["cache_size_before"]
        if case["max_cosine_before"] is None:
            assert body["novelty"]["reason"] == "cache_empty"
        else:
            assert body["novelty"]["measured"] is True
            assert body["novelty"]["max_cosine"] == pytest.approx(
                case["max_cosine_before"], abs=1e-6
            )
    for server in replicas:
        stats = server.client.get("/cache", headers=AUTH).json()
        assert stats["size"] == len(SEQUENCE)
        assert stats["backend"] == {
            "kind": "redis",
            "shared": True,
            "location": f"redis://127.0.0.1:{redis_server.port}/0",  # no password
            "prefix": PREFIX,
            "available": True,
            "reason": None,
            "outages_total": 0,
        }
        ready = server.client.get("/readyz").json()
        assert ready["status"] == "ready"
        assert ready["cache_backend"]["shared"] is True
    assert len(shared_log(redis_server)) == len(SEQUENCE)


def test_concurrent_bursts_over_replicas_equal_one_order(
    replicas: list[LiveServer], redis_server: RedisServer
) -> None:
    """Singles, batches and dry runs sent at once, round robin. Each added trace's cache_size
    is its place in the order (capacity is not reached); replaying that order one at a time,
    with each dry run where its cache_size puts it, must give the same answers."""
    traces = [
        make_trace(
            trace_id=f"kp:trace:burst-{i}",
            objective=TOPICS[i % len(TOPICS)] + ("" if i < len(TOPICS) else " (again)"),
            steps=[step(0, "thought", TOPICS[i % 5].lower()), step(1, "tool_call", "look", "t")],
        )
        for i in range(18)
    ]
    # (path, body, dry run): 12 singles, 3 batches of 2, 3 dry runs.
    requests: list[tuple[str, Any, bool]] = [("/evaluate", t, False) for t in traces[:12]]
    requests += [
        ("/evaluate/batch", {"traces": traces[i : i + 2]}, False) for i in range(12, 18, 2)
    ]
    requests += [("/evaluate", traces[i], True) for i in (0, 5, 13)]
    requests = [requests[i] for i in (3, 14, 0, 16, 7, 12, 1, 17, 9, 4, 13, 2, 8, 15, 5, 11, 10, 6)]
    reset(replicas)

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        replicas[i % 3].url + path, json=body, params={"dry_run": str(dry).lower()}
                    )
                    for i, (path, body, dry) in enumerate(requests)
                )
            )

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * len(requests)
    added: dict[int, tuple[str, Any, list[dict[str, Any]]]] = {}
    dry_runs: list[tuple[int, dict[str, Any], dict[str, Any]]] = []
    for (path, body, dry), r in zip(requests, responses, strict=True):
        results = r.json()["results"] if path.endswith("batch") else [r.json()]
        sizes = [res["novelty"]["cache_size"] for res in results]
        if dry:
            dry_runs.append((sizes[0], body, results[0]))
            continue
        # A batch's traces are consecutive in the order.
        assert sizes == list(range(sizes[0], sizes[0] + len(results)))
        added[sizes[0]] = (path, body, results)
    order = sorted(added)
    places = [p for start in order for p in range(start, start + len(added[start][2]))]
    assert places == list(range(len(traces)))  # every place in the order taken exactly once
    expected_log = [res["trace_id"] for start in order for res in added[start][2]]
    assert shared_log(redis_server) == expected_log

    reset(replicas)
    one = replicas[0]
    replayed_dry_runs = 0
    for start in [*order, len(traces)]:
        for size, body, result in dry_runs:
            if size == start:
                replay = one.client.post("/evaluate", json=body, params={"dry_run": "true"})
                assert_same(replay.json(), result)
                replayed_dry_runs += 1
        if start in added:
            path, body, results = added[start]
            replay = one.post(path, body).json()
            for again, first in zip(replay.get("results", [replay]), results, strict=True):
                assert_same(again, first)
    assert replayed_dry_runs == len(dry_runs)  # none saw the middle of a batch


def assert_same(replay: dict[str, Any], first: dict[str, Any]) -> None:
    assert replay["trace_id"] == first["trace_id"]
    assert replay["novelty"]["cache_size"] == first["novelty"]["cache_size"]
    assert replay["novelty"]["reason"] == first["novelty"]["reason"]
    assert replay["score"] == pytest.approx(first["score"], abs=SCORE_TOLERANCE)
    if first["novelty"]["max_cosine"] is not None:
        assert replay["novelty"]["max_cosine"] == pytest.approx(
            first["novelty"]["max_cosine"], abs=1e-6
        )


def test_delete_on_one_replica_empties_the_cache_of_all(replicas: list[LiveServer]) -> None:
    reset(replicas)
    for i, topic in enumerate(TOPICS[:3]):
        replicas[i].post("/evaluate", make_trace(objective=topic))
    assert replicas[0].client.get("/cache", headers=AUTH).json()["size"] == 3
    cleared = replicas[2].client.delete("/cache", headers=AUTH).json()
    assert cleared == {"cleared": 3}
    assert replicas[0].client.get("/cache", headers=AUTH).json()["size"] == 0
    again = replicas[1].post("/evaluate", make_trace(objective=TOPICS[0])).json()
    assert again["novelty"]["reason"] == "cache_empty"


def test_redis_killed_under_load_then_restarted(
    replicas: list[LiveServer], redis_server: RedisServer
) -> None:
    """During the outage every answer is 200 with cache_unavailable; each replica logs the
    outage once and its end once; every trace whose answer said it was added is in the
    memory after Redis replays its append-only file."""
    reset(replicas)
    answers: list[dict[str, Any]] = []
    statuses: list[int] = []
    stop = threading.Event()

    def load(worker: int) -> None:
        with httpx.Client(timeout=60) as client:
            i = 0
            while not stop.is_set():
                trace = make_trace(
                    trace_id=f"kp:trace:load-{worker}-{i}",
                    objective=f"{TOPICS[i % len(TOPICS)]}, case {worker}-{i}",
                )
                r = client.post(replicas[(worker + i) % 3].url + "/evaluate", json=trace)
                statuses.append(r.status_code)
                if r.status_code == 200:
                    answers.append(r.json())
                i += 1

    def wait_for(condition: Any, what: str) -> None:
        deadline = time.monotonic() + 120
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.02)

    def unavailable() -> int:
        return sum(a["novelty"]["reason"] == "cache_unavailable" for a in answers)

    workers = [threading.Thread(target=load, args=(w,)) for w in range(3)]
    for w in workers:
        w.start()
    try:
        wait_for(lambda: len(answers) >= 9, "answers before the kill")
        redis_server.stop(signal.SIGKILL)
        wait_for(lambda: unavailable() >= 12, "answers during the outage")
        for server in replicas:
            ready = server.client.get("/readyz").json()
            assert ready["status"] == "degraded"
            assert ready["cache_backend"]["available"] is False
            assert any("shared cache" in w for w in ready["warnings"])
            metrics = server.client.get("/metrics").text
            assert re.search(r"^kp_cache_available 0\.0$", metrics, re.M)
            assert re.search(r'kp_novelty_unmeasured_total\{reason="cache_unavailable"\}', metrics)
        redis_server.start()  # from its append-only file
        wait_for(
            lambda: all(s.client.get("/readyz").json()["status"] == "ready" for s in replicas),
            "the replicas to reconnect",
        )
        measured_after = len(answers)
        wait_for(lambda: len(answers) >= measured_after + 9, "answers after the restart")
    finally:
        stop.set()
        for w in workers:
            w.join()
        if redis_server.process is None:
            redis_server.start()

    assert set(statuses) == {200}
    assert answers[-1]["novelty"]["measured"] is True
    reasons = {a["novelty"]["reason"] for a in answers}
    assert reasons <= {None, "cache_empty", "cache_unavailable"}
    acknowledged = {
        a["trace_id"]
        for a in answers
        if a["novelty"]["measured"] or a["novelty"]["reason"] == "cache_empty"
    }
    assert acknowledged <= set(shared_log(redis_server))
    for server in replicas:
        log = full_log(server)
        assert log.count('"shared cache unavailable') == 1, log
        assert log.count('"shared cache available again"') == 1, log
        assert "s3cret-redis-pw" not in log
        backend = server.client.get("/cache", headers=AUTH).json()["backend"]
        assert backend["outages_total"] == 1


def test_the_password_is_never_shown(replicas: list[LiveServer]) -> None:
    for server in replicas:
        for path in ("/cache", "/readyz", "/metrics"):
            assert "s3cret-redis-pw" not in server.client.get(path, headers=AUTH).text
        assert "s3cret-redis-pw" not in full_log(server)
