"""The memory holds only unit vectors of real traces: an import of hostile vectors (a stored
one scaled by 1000, a random direction of length 50, zero, NaN) is refused line by line or
stored at length 1, so every known trace stays its own nearest at cosine 1, in process and
with a real redis-server; and the exact search finds the true maximum cosine whatever rows
it holds (a property test against a plain float64 loop)."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import orjson
import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from app.memory.ring import VectorCache
from tests.conftest import ClientFactory
from tests.factories import TOPICS, make_trace
from tests.server import RedisServer

TOKEN = "poison-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NDJSON = {"Content-Type": "application/x-ndjson"}
KNOWN = TOPICS[:5]


def line(trace_id: str, vector: np.ndarray[Any, Any]) -> bytes:
    data = np.asarray(vector, dtype="<f4").tobytes()
    item = {"trace_id": trace_id, "added_at_ms": 1.0, "vector": base64.b64encode(data).decode()}
    return orjson.dumps(item) + b"\n"


def exported(client: TestClient) -> list[dict[str, Any]]:
    r = client.get("/cache/export", headers=AUTH)
    return [orjson.loads(x) for x in r.content.splitlines() if x.strip()]


def poison_and_check(client: TestClient) -> None:
    for i, topic in enumerate(KNOWN):
        r = client.post("/evaluate", json=make_trace(objective=topic, trace_id=f"kp:trace:k{i}"))
        assert r.status_code == 200, r.text
    stored = {
        e["trace_id"]: np.frombuffer(base64.b64decode(e["vector"]), "<f4") for e in exported(client)
    }
    rng = np.random.default_rng(7)
    direction = rng.standard_normal(384)

    # Refused: the line and the rule are named, nothing is added.
    for bad, rule in (
        (np.zeros(384), "vector must not be zero"),
        (np.full(384, np.nan), "vector must be finite"),
        (np.r_[np.ones(383), np.inf], "vector must be finite"),
    ):
        body = line("kp:trace:fine", stored["kp:trace:k0"]) + line("kp:trace:bad", bad)
        r = client.post("/cache/import", content=body, headers=AUTH | NDJSON)
        assert r.status_code == 422, r.text
        (error,) = r.json()["detail"]
        assert error["loc"] == ["body", 2]
        assert error["msg"].startswith(f"line 2: {rule}"), error["msg"]
    assert len(exported(client)) == len(KNOWN)

    # Accepted at length 1: they are directions, no longer weights.
    body = b"".join(
        [
            line("kp:trace:scaled", stored["kp:trace:k0"] * 1000),
            line("kp:trace:long", direction / np.linalg.norm(direction) * 50),
            line("kp:trace:tiny", stored["kp:trace:k1"] * 1e-30),
        ]
    )
    r = client.post("/cache/import", content=body, headers=AUTH | NDJSON)
    assert r.status_code == 200, r.text
    for e in exported(client):
        v = np.frombuffer(base64.b64decode(e["vector"]), "<f4").astype(np.float64)
        assert abs(np.linalg.norm(v) - 1) < 1e-5, e["trace_id"]

    for i, topic in enumerate(KNOWN):
        trace = make_trace(objective=topic, trace_id="kp:trace:again")
        r = client.post("/evaluate", params={"dry_run": "true"}, json=trace)
        novelty = r.json()["novelty"]
        assert novelty["max_cosine"] == pytest.approx(1.0, abs=1e-6)
        # The scaled copies of k0 and k1 are their equals now (to float32's rounding).
        copy = {0: "kp:trace:scaled", 1: "kp:trace:tiny"}.get(i)
        assert novelty["nearest"]["trace_id"] in (f"kp:trace:k{i}", copy)


def test_a_poisoned_import_changes_no_trace_s_nearest_in_process(
    make_client: ClientFactory,
) -> None:
    poison_and_check(make_client(admin_token=TOKEN))


def test_a_poisoned_import_changes_no_trace_s_nearest_in_redis_mode(
    make_client: ClientFactory, redis_server: RedisServer, redis_prefix: str
) -> None:
    settings = {"admin_token": TOKEN, "redis_url": redis_server.url, "redis_prefix": redis_prefix}
    importer = make_client(**settings)
    poison_and_check(importer)
    other = make_client(**settings)  # another replica reads the same log
    for i, topic in enumerate(KNOWN[2:], start=2):
        trace = make_trace(objective=topic, trace_id="kp:trace:again")
        novelty = other.post("/evaluate", params={"dry_run": "true"}, json=trace).json()["novelty"]
        assert novelty["nearest"]["trace_id"] == f"kp:trace:k{i}"
        assert novelty["max_cosine"] == pytest.approx(1.0, abs=1e-6)


DIM = 8
finite32 = st.floats(-1.0, 1.0, width=32)
# Lengths from the subnormal to near float32's largest: whatever a memory might hold.
scales = st.sampled_from([0.0, 1e-38, 1e-30, 1e-6, 1.0, 50.0, 1e3, 1e20, 1e30])


def reference_best(rows: list[np.ndarray[Any, Any]], q: np.ndarray[Any, Any]) -> float:
    """The brief's loop in float64: the largest cosine, a zero row counting 0."""
    best = -1.0
    qn = float(np.sqrt(sum(float(x) * float(x) for x in q)))
    for row in rows:
        rn = float(np.sqrt(sum(float(x) * float(x) for x in row)))
        dot = sum(float(a) * float(b) for a, b in zip(row, q, strict=True))
        best = max(best, 0.0 if rn * qn == 0 else dot / (rn * qn))
    return best


@settings(max_examples=300, deadline=None)
@given(
    directions=st.lists(arrays(np.float32, DIM, elements=finite32), min_size=1, max_size=40),
    lengths=st.lists(scales, min_size=40, max_size=40),
    query=arrays(np.float32, DIM, elements=finite32),
    capacity=st.integers(1, 40),
)
def test_the_exact_search_finds_the_true_maximum_whatever_the_norms(
    directions: list[np.ndarray[Any, Any]],
    lengths: list[float],
    query: np.ndarray[Any, Any],
    capacity: int,
) -> None:
    cache = VectorCache(capacity=capacity, dimensions=DIM)
    rows = []
    for i, direction in enumerate(directions):
        norm = float(np.linalg.norm(direction.astype(np.float64)))
        row = (direction / norm * lengths[i] if norm else direction).astype(np.float32)
        rows.append(row)
        cache.add(row, trace_id=f"kp:trace:{i}")
    live = rows[-capacity:]
    found = cache.nearest(query)
    assert found is not None
    assert found.cosine == pytest.approx(reference_best(live, query), abs=1e-9)
