"""GET /cache/export and POST /cache/import: NDJSON lines, oldest first, all or nothing;
a memory moved from one service to another (in process -> Redis -> in process) answers the
same, with the real model and a real redis-server."""

from __future__ import annotations

import base64
import time
from typing import Any

import orjson
import pytest
from fastapi.testclient import TestClient

from tests.conftest import ClientFactory
from tests.factories import TOPICS, export_line, make_trace, random_units, step
from tests.server import RedisServer

TOKEN = "transfer-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NDJSON = {"Content-Type": "application/x-ndjson"}


def lines_of(client: TestClient) -> list[dict[str, Any]]:
    r = client.get("/cache/export", headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/x-ndjson")
    return [orjson.loads(line) for line in r.content.splitlines() if line.strip()]


def body(entries: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(e) + b"\n" for e in entries)


def entry(trace_id: str, added_at_ms: float, seed: int) -> dict[str, Any]:
    return export_line(trace_id, random_units(1, seed)[0], added_at_ms)


def probe(client: TestClient, objective: str) -> dict[str, Any]:
    trace = make_trace(
        objective=objective, steps=[step(0, "thought", objective)], trace_id="kp:trace:probe"
    )
    r = client.post("/evaluate", params={"dry_run": "true"}, json=trace)
    assert r.status_code == 200, r.text
    novelty: dict[str, Any] = r.json()["novelty"]
    return novelty


def test_a_memory_moves_in_process_to_redis_and_back_with_the_same_answers(
    make_client: ClientFactory, redis_server: RedisServer, redis_prefix: str
) -> None:
    first = make_client(admin_token=TOKEN)
    for i, topic in enumerate(TOPICS[:6]):
        trace = make_trace(objective=topic, trace_id=f"kp:trace:t{i}")
        assert first.post("/evaluate", json=trace).status_code == 200
    exported = lines_of(first)
    assert [e["trace_id"] for e in exported] == [f"kp:trace:t{i}" for i in range(6)]
    times = [e["added_at_ms"] for e in exported]
    assert times == sorted(times)
    assert all(len(base64.b64decode(e["vector"])) == 384 * 4 for e in exported)

    shared = make_client(admin_token=TOKEN, redis_url=redis_server.url, redis_prefix=redis_prefix)
    r = shared.post("/cache/import", content=body(exported), headers=AUTH | NDJSON)
    assert r.status_code == 200, r.text
    assert r.json() == {"imported": 6, "expired": 0, "lines": 6}
    via_redis = lines_of(shared)
    assert [(e["trace_id"], e["vector"]) for e in via_redis] == [
        (e["trace_id"], e["vector"]) for e in exported
    ]

    last = make_client(admin_token=TOKEN)
    r = last.post("/cache/import", content=body(via_redis), headers=AUTH | NDJSON)
    assert r.json()["imported"] == 6
    for topic in (TOPICS[2], TOPICS[7], "Bake sourdough bread"):
        answers = [probe(c, topic) for c in (first, shared, last)]
        assert answers[0]["max_cosine"] is not None
        for other in answers[1:]:
            assert other["max_cosine"] == pytest.approx(answers[0]["max_cosine"], abs=1e-12)
            assert other["nearest"]["trace_id"] == answers[0]["nearest"]["trace_id"]
            assert other["cache_size"] == 6


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        (b"{not json", "not JSON"),
        (b'["a list"]', "must be a JSON object"),
        (b'{"trace_id": "x", "added_at_ms": 1.0}', "missing vector"),
        (b'{"trace_id": "x", "added_at_ms": 1.0, "vector": "!!!"}', "not valid base64"),
        (b'{"trace_id": "x", "added_at_ms": 1.0, "vector": "AAAA"}', "holds 3 bytes"),
        (b'{"trace_id": 7, "added_at_ms": 1.0, "vector": ""}', "trace_id must be a string"),
        (b'{"trace_id": "x", "added_at_ms": "soon", "vector": ""}', "added_at_ms must be"),
    ],
)
def test_a_bad_line_is_named_and_nothing_is_imported(
    make_client: ClientFactory, bad: bytes, problem: str
) -> None:
    client = make_client(embedder="none", admin_token=TOKEN)
    now = time.time() * 1000
    good = body([entry("kp:trace:a", now, 1), entry("kp:trace:b", now, 2)])
    r = client.post("/cache/import", content=good + b"\n" + bad + b"\n", headers=AUTH | NDJSON)
    assert r.status_code == 422, r.text
    (detail,) = r.json()["detail"]
    assert detail["line"] == 4  # two good lines, a blank one, then the bad one
    assert detail["msg"].startswith("line 4: ")
    assert problem in detail["msg"]
    assert client.get("/cache", headers=AUTH).json()["size"] == 0


def test_expired_entries_are_skipped_and_counted(make_client: ClientFactory) -> None:
    client = make_client(embedder="none", admin_token=TOKEN, cache_ttl_ms=60_000)
    now = time.time() * 1000
    lines = [entry("old", now - 120_000, 1), entry("recent", now - 1_000, 2)]
    r = client.post("/cache/import", content=body(lines), headers=AUTH | NDJSON)
    assert r.json() == {"imported": 1, "expired": 1, "lines": 2}
    (kept,) = lines_of(client)
    assert kept["trace_id"] == "recent"
    assert kept["added_at_ms"] == pytest.approx(now - 1_000)


def test_import_is_for_admins_ndjson_and_bounded(make_client: ClientFactory) -> None:
    client = make_client(embedder="none", admin_token=TOKEN, cache_import_max_bytes=1_048_576)
    one = body([entry("a", time.time() * 1000, 1)])
    assert client.post("/cache/import", content=one, headers=NDJSON).status_code == 401
    assert client.get("/cache/export").status_code == 401
    wrong = client.post(
        "/cache/import", content=one, headers=AUTH | {"Content-Type": "application/json"}
    )
    assert wrong.status_code == 415
    assert "application/x-ndjson" in wrong.text
    big = one * (1_048_576 // len(one) + 1)
    too_large = client.post("/cache/import", content=big, headers=AUTH | NDJSON)
    assert too_large.status_code == 413
    assert "KP_CACHE_IMPORT_MAX_BYTES" in too_large.text
    assert client.get("/cache", headers=AUTH).json()["size"] == 0
    # Capacity applies: the newest entries stay.
    small = make_client(embedder="none", admin_token=TOKEN, cache_capacity=2)
    lines = [entry(f"e{i}", time.time() * 1000, i) for i in range(5)]
    assert small.post("/cache/import", content=body(lines), headers=AUTH | NDJSON).json() == {
        "imported": 5,
        "expired": 0,
        "lines": 5,
    }
    assert [e["trace_id"] for e in lines_of(small)] == ["e3", "e4"]
