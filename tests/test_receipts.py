"""A commit keeps its receipt: a retry under the same Idempotency-Key whose first answer a crash
lost (with the in-process idempotency record) gets the same comparisons and adds nothing, in a
real SQLite file across a restart, in a real Redis, and through a live server killed -9
between the answer and the retry."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import numpy as np
import pytest

from app.memory.base import DEFAULT_NAMESPACE
from tests.factories import make_trace, random_units
from tests.server import LiveServer, RedisServer
from tests.test_persistence import exported, memory_at
from tests.test_redis_vectors import replicas, run


def test_a_receipt_in_the_database_answers_a_retry_after_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    memory = memory_at(path)
    earlier, trace = random_units(3, seed=1), random_units(1, seed=2)

    async def compare(receipt: str | None) -> list[object]:
        found = await memory.compare(
            DEFAULT_NAMESPACE, list(trace), ["kp:trace:t"], add=True, receipt=receipt
        )
        return list(found)

    asyncio.run(memory.compare(DEFAULT_NAMESPACE, list(earlier), ["a", "b", "c"], add=True))
    first = asyncio.run(compare("key-1"))
    assert len(exported(memory).ids()) == 4
    asyncio.run(memory.close())  # a crash is the live test's, below: here a restart
    memory = memory_at(path)
    again = asyncio.run(compare("key-1"))
    assert again == first
    assert len(exported(memory).ids()) == 4  # added once
    other = asyncio.run(compare("key-2"))  # another key is another request: it adds
    assert other != first
    assert len(exported(memory).ids()) == 5


@pytest.mark.redis
def test_a_receipt_in_redis_answers_a_retry_and_adds_nothing(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    vectors = random_units(4, seed=3)

    async def scenario() -> None:
        async with replicas(redis_server.url, redis_prefix) as (first, second):
            await first.compare(DEFAULT_NAMESPACE, list(vectors[:3]), ["a", "b", "c"], add=True)
            answered = await first.compare(
                DEFAULT_NAMESPACE, [vectors[3]], ["kp:trace:t"], add=True, receipt="key-1"
            )
            # The replica that answered died; another gets the retry.
            retried = await second.compare(
                DEFAULT_NAMESPACE, [vectors[3]], ["kp:trace:t"], add=True, receipt="key-1"
            )
            assert retried == answered
            assert answered[0].nearest is not None
            assert (await second.stats(DEFAULT_NAMESPACE)).size == 4
            fresh = await second.compare(
                DEFAULT_NAMESPACE, [vectors[3]], ["kp:trace:t"], add=True, receipt="key-2"
            )
            assert fresh[0].max_cosine == pytest.approx(1.0, abs=1e-6)
            assert (await second.stats(DEFAULT_NAMESPACE)).size == 5

    run(scenario)


@pytest.mark.server
def test_a_retry_after_kill_9_gets_the_first_answer_and_stores_nothing_twice(
    tmp_path: Path,
) -> None:
    env = {"KP_CACHE_DB_PATH": str(tmp_path / "memory.db"), "KP_ADMIN_TOKEN": "t"}
    admin = {"Authorization": "Bearer t"}
    key = {"Idempotency-Key": "retry-after-crash"}
    earlier = make_trace(trace_id="kp:trace:earlier", objective="Reconcile the Q3 ledger")
    trace = make_trace(trace_id="kp:trace:retried", objective="Reconcile the Q3 ledgers")
    server = LiveServer(env, tmp_path / "first.log")
    try:
        assert server.post("/evaluate", earlier).status_code == 200
        first = server.client.post("/evaluate", json=trace, headers=key)
        assert first.status_code == 200
    finally:
        server.stop(signal.SIGKILL)  # the answer is out; its in-process record dies here
    server = LiveServer(env, tmp_path / "second.log")
    try:
        again = server.client.post("/evaluate", json=trace, headers=key)
        assert again.status_code == 200
        shown, kept = first.json(), again.json()
        for answer in (shown, kept):
            del answer["elapsed_ms"]
        assert kept == shown  # the first commit's comparison, not one with itself
        assert kept["novelty"]["nearest"]["trace_id"] == "kp:trace:earlier"
        lines = server.client.get("/cache/export", headers=admin).text.splitlines()
        assert len(lines) == 2  # the retried trace once
        assert np.isclose(kept["novelty"]["max_cosine"], shown["novelty"]["max_cosine"])
    finally:
        server.stop()
