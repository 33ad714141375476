"""A graph built once serves again: a restart adopts the one saved beside its snapshot, and a
replica of a shared memory adopts the one another replica published in Redis, instead of
building (docs/decisions/index-graph-adopted.md). A graph that does not fit is ignored and
the cache builds as without it; every answer stays the exact scan's on planted near-duplicates."""

from __future__ import annotations

import asyncio
import itertools
import time
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from app.domain.vector_cache import CacheEntries
from app.services.cache_transfer import export_lines
from app.store.ann_index import AnnIndex
from app.store.base import DEFAULT_NAMESPACE as NS
from app.store.indexed_memory import (
    HAND_ON_GROWTH,
    TAIL_BATCH,
    BuiltGraph,
    IndexedCache,
)
from app.store.redis_shared import RedisSharedMemory
from tests.factories import TOPICS, make_trace
from tests.server import TOKEN, LiveServer, RedisServer
from tests.test_large_memory import clustered, edit
from tests.test_redis_store import replicas, run

N = 5_000
DIMS = 384
THRESHOLD = 2_000


@pytest.fixture(scope="module")
def stored() -> npt.NDArray[np.float32]:
    return clustered(N, seed=21)


def exact_of(entries: CacheEntries) -> IndexedCache:
    cache = IndexedCache(capacity=N, search="exact")
    cache.load(entries)
    return cache


def assert_finds_planted(
    stored: npt.NDArray[np.float32], answer: Any, truth: IndexedCache, count: int = 60
) -> None:
    """`answer(query)` -> (max_cosine, trace id) equals the exact scan's and names the
    planted entry, for near-duplicates of stored vectors."""
    rng = np.random.default_rng(5)
    for i in rng.choice(len(stored), count, replace=False):
        query = edit(stored[i], rng, 0.3)
        expected = truth.nearest(query)
        assert expected is not None
        assert answer(query) == (expected.cosine, expected.trace_id)
        assert expected.trace_id == f"t{i}"


def nearest_of(cache: IndexedCache) -> Any:
    def answer(query: npt.NDArray[np.float32]) -> tuple[float, str]:
        found = cache.nearest(query)
        assert found is not None
        return found.cosine, found.trace_id

    return answer


def test_the_feeder_hands_on_the_graph_it_grew_by_a_tenth(
    stored: npt.NDArray[np.float32],
) -> None:
    """The entries the feeder adds to a serving graph reach its owner too (every tenth of
    growth): a cache adopting the last graph handed on has nothing left to insert."""
    built: list[BuiltGraph] = []
    cache = IndexedCache(capacity=N, index_threshold=THRESHOLD)  # background threads
    cache.on_graph_built = built.append
    first = THRESHOLD + TAIL_BATCH
    for i, v in enumerate(stored[:first]):
        cache.add(v, trace_id=f"t{i}")
    assert cache.wait_for_index(timeout_s=600)
    assert len(built) == 1
    for i in range(first, N):
        cache.add(stored[i], trace_id=f"t{i}")
    deadline = time.monotonic() + 600
    while built[-1].count < N - TAIL_BATCH and time.monotonic() < deadline:
        time.sleep(0.05)  # the feeder works in its own thread
    counts = [graph.count for graph in built]
    assert counts[-1] >= N - TAIL_BATCH
    # Each handed on once it had grown by a tenth, not with every insert.
    assert all(b >= a * (1 + HAND_ON_GROWTH) for a, b in itertools.pairwise(counts))
    assert cache.index_status().builds_total == 1  # grown, not built again
    latest = built[-1]
    adopter = IndexedCache(capacity=N, index_threshold=THRESHOLD)
    adopter.hold_index(True)
    adopter.extend(
        stored[: latest.count], np.zeros(latest.count), cache.entries().ids()[: latest.count]
    )
    assert adopter.adopt_index(AnnIndex.from_bytes(latest.data, DIMS, 0), 0) is None
    adopter.hold_index(False)
    status = adopter.index_status()
    assert (status.state, status.indexed, status.builds_total) == ("ready", latest.count, 0)
    assert_finds_planted(stored[: latest.count], nearest_of(adopter), exact_of(adopter.entries()))


# ── shared mode ────────────────────────────────────────────────────────────


def replica(
    redis: RedisServer, prefix: str, **settings: Any
) -> AbstractAsyncContextManager[list[RedisSharedMemory]]:
    """One replica of these tests' memory, started, closed on leaving."""
    return replicas(redis, prefix, count=1, capacity=N, index_threshold=THRESHOLD, **settings)


async def _until(check: Any, what: str) -> None:
    """Waits for check() (the bound only stops a broken test hanging)."""
    for _ in range(1200):
        if check():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"not {what} after two minutes")


async def _ready(memory: RedisSharedMemory) -> None:
    await _until(
        lambda: (
            memory.warming is None
            and not memory.index_status().warming
            and memory.index_status().state == "ready"
        ),
        "ready",
    )


async def _planted_answers(
    memory: RedisSharedMemory, stored: npt.NDArray[np.float32]
) -> list[tuple[float | None, str]]:
    rng = np.random.default_rng(5)
    out = []
    for i in rng.choice(len(stored), 60, replace=False):
        (found,) = await memory.compare(NS, [edit(stored[i], rng, 0.3)], ["q"], add=False)
        assert found.nearest is not None
        out.append((found.max_cosine, found.nearest.trace_id))
    return out


def _expected(stored: npt.NDArray[np.float32]) -> list[tuple[float | None, str]]:
    truth = exact_of(CacheEntries(stored, np.zeros(len(stored)), [f"t{i}" for i in range(N)]))
    rng = np.random.default_rng(5)
    out = []
    for i in rng.choice(len(stored), 60, replace=False):
        found = truth.nearest(edit(stored[i], rng, 0.3))
        assert found is not None
        assert found.trace_id == f"t{i}"
        out.append((found.cosine, found.trace_id))
    return out


def _graph_keys(redis: RedisServer, prefix: str) -> list[bytes]:
    with redis.client() as client:
        return list(client.scan_iter(match=f"{prefix}novelty:graph*"))


def test_a_new_replica_adopts_the_published_graph_and_a_reset_deletes_it(
    redis_server: RedisServer, redis_prefix: str, stored: npt.NDArray[np.float32]
) -> None:
    expected = _expected(stored)

    def entries() -> CacheEntries:
        return CacheEntries(stored, np.full(N, time.time() * 1000), [f"t{i}" for i in range(N)])

    async def scenario() -> None:
        async with replica(redis_server, redis_prefix) as (first,):
            assert await first.import_entries(NS, entries()) == (N, 0)
            await _ready(first)
            await _until(lambda: len(_graph_keys(redis_server, redis_prefix)) >= 2, "published")
            assert first.index_status().builds_total >= 1
            assert await _planted_answers(first, stored) == expected

            async with replica(redis_server, redis_prefix) as (second,):
                await _ready(second)
                status = second.index_status()
                assert (status.builds_total, status.adoptions_total) == (0, 1)
                assert status.indexed >= THRESHOLD
                assert await _planted_answers(second, stored) == expected

            # A damaged published graph: the next replica ignores it and builds.
            with redis_server.client() as client:
                (damaged,) = [
                    k for k in _graph_keys(redis_server, redis_prefix) if k.endswith(b":0")
                ]
                client.setrange(damaged, 1000, b"\x00" * 64)
            async with replica(redis_server, redis_prefix) as (third,):
                await _ready(third)
                status = third.index_status()
                assert (status.builds_total, status.adoptions_total) == (1, 0)
                assert await _planted_answers(third, stored) == expected
                # ... and replaces it with its own.
                await _until(
                    lambda: damaged not in _graph_keys(redis_server, redis_prefix), "replaced"
                )

            assert await first.clear(NS) == N
            assert _graph_keys(redis_server, redis_prefix) == []

        # Refilled by a replica that does not publish: a new one finds no graph to adopt.
        async with replica(redis_server, redis_prefix, index_share=False) as (writer,):
            assert await writer.import_entries(NS, entries()) == (N, 0)
            await _ready(writer)
            assert _graph_keys(redis_server, redis_prefix) == []
            async with replica(redis_server, redis_prefix) as (fresh,):
                await _ready(fresh)
                status = fresh.index_status()
                assert (status.builds_total, status.adoptions_total) == (1, 0)
                assert await _planted_answers(fresh, stored) == expected

    run(scenario)


def _published_count(redis: RedisServer, prefix: str) -> int:
    with redis.client() as client:
        return int(client.hget(f"{prefix}novelty:graph", "count") or 0)


def test_a_replica_serializes_a_grown_graph_only_when_it_would_publish_it(
    redis_server: RedisServer, redis_prefix: str, stored: npt.NDArray[np.float32]
) -> None:
    """Every replica grows its graph with the same log, but one graph is published: the
    feeder asks Redis first, and a replica whose graph would not be published (another
    holds the lease, or keeps the published one current) does not serialize it (0.9 GB and
    seconds of a core at a million entries)."""
    start, step = 3_000, 600  # a step grows the graph by more than a tenth

    def entries(lo: int, hi: int) -> CacheEntries:
        now = time.time() * 1000
        return CacheEntries(stored[lo:hi], np.full(hi - lo, now), [f"t{i}" for i in range(lo, hi)])

    async def scenario() -> None:
        async with replica(redis_server, redis_prefix) as (memory,):
            handed: list[BuiltGraph] = []
            publish = memory.mirror.on_graph_built
            assert publish is not None

            def counted(built: BuiltGraph) -> None:
                handed.append(built)
                publish(built)

            memory.mirror.on_graph_built = counted
            assert await memory.import_entries(NS, entries(0, start)) == (start, 0)
            await _ready(memory)
            await _until(lambda: len(_graph_keys(redis_server, redis_prefix)) >= 2, "published")
            built_at_start = len(handed)
            lease = f"{redis_prefix}novelty:graph:lease"
            with redis_server.client() as client:
                client.set(lease, "another replica", px=120_000)

            assert await memory.import_entries(NS, entries(start, start + step)) == (step, 0)
            await _until(lambda: memory.index_status().indexed == start + step, "fed")
            assert len(handed) == built_at_start  # another replica publishes: not serialized

            with redis_server.client() as client:
                client.delete(lease)
            stop = start + 2 * step
            assert await memory.import_entries(NS, entries(start + step, stop)) == (step, 0)
            await _until(lambda: memory.index_status().indexed == stop, "fed")
            await _until(lambda: len(handed) > built_at_start, "handed on")
            assert handed[-1].count > start + step
            await _until(
                lambda: _published_count(redis_server, redis_prefix) == handed[-1].count,
                "published",
            )

    run(scenario)


@pytest.mark.server
@pytest.mark.redis
@pytest.mark.slow
def test_a_new_service_process_adopts_the_graph_of_another(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    """Two service processes with the real model on one redis-server: the first scores some
    traces, then an import takes the memory past KP_CACHE_INDEX_THRESHOLD; its graph is
    published; the second adopts it (no build: /readyz and /metrics say so) and both name the
    scored traces as the nearest to dry runs of themselves, with the same answers."""
    env = {
        "KP_EMBEDDER": "onnx",
        "KP_EMBEDDER_PRELOAD": "true",
        "KP_EMBEDDER_WORKERS": "1",
        "KP_EMBEDDER_THREADS": "1",
        "KP_LOG_LEVEL": "info",
        "KP_ADMIN_TOKEN": TOKEN,
        "KP_REDIS_URL": redis_server.url,
        "KP_REDIS_PREFIX": redis_prefix,
        "KP_REDIS_TIMEOUT_MS": "10000",
        "KP_EMBED_MAX_WAIT_MS": "60000",
        "KP_CACHE_CAPACITY": str(N),
        "KP_CACHE_INDEX_THRESHOLD": "1000",
    }
    auth = {"Authorization": f"Bearer {TOKEN}"}
    traces = [
        make_trace(objective=topic, trace_id=f"kp:trace:planted-{i}")
        for i, topic in enumerate(TOPICS[:6])
    ]
    first = LiveServer(env, tmp_path / "first.log")
    try:
        for trace in traces:
            assert first.post("/evaluate", trace).status_code == 200
        distractors = clustered(3000, seed=31)
        body = b"".join(
            export_lines(
                [
                    CacheEntries(
                        distractors,
                        np.full(len(distractors), time.time() * 1000),
                        [f"kp:trace:d{i}" for i in range(len(distractors))],
                    )
                ]
            )
        )
        r = first.client.post(
            "/cache/import",
            content=body,
            headers=auth | {"content-type": "application/x-ndjson"},
        )
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 120
        while not _graph_keys(redis_server, redis_prefix) or (
            first.client.get("/readyz").json()["cache_index"]["state"] != "ready"
        ):
            assert time.monotonic() < deadline, first.log()
            time.sleep(0.2)
        assert first.client.get("/readyz").json()["cache_index"]["builds_total"] >= 1

        second = LiveServer(env, tmp_path / "second.log")
        try:
            deadline = time.monotonic() + 120
            while (ready := second.client.get("/readyz").json())["status"] != "ready":
                assert time.monotonic() < deadline, second.log()
                time.sleep(0.2)
            index = ready["cache_index"]
            assert (index["builds_total"], index["adoptions_total"]) == (0, 1)
            assert "kp_cache_index_adoptions_total 1.0" in second.client.get("/metrics").text
            for trace in traces:
                answers = []
                for server in (first, second):
                    r = server.client.post("/evaluate", params={"dry_run": "true"}, json=trace)
                    assert r.status_code == 200, r.text
                    novelty = r.json()["novelty"]
                    assert novelty["cache_size"] == len(traces) + len(distractors)
                    answers.append((novelty["max_cosine"], novelty["nearest"]["trace_id"]))
                assert answers[0] == answers[1]
                assert answers[0][1] == trace["id"]
                assert answers[0][0] == pytest.approx(1.0, abs=1e-6)
        finally:
            second.stop()
    finally:
        first.stop()


def test_a_graph_is_written_in_faiss_s_own_format_and_read_back(
    stored: npt.NDArray[np.float32],
) -> None:
    """AnnIndex.to_bytes streams through faiss's callback writer (no whole copies of the
    graph): the bytes are faiss's own serialization, byte for byte, and read back into a graph
    that answers as the original."""
    import faiss

    graph = AnnIndex(DIMS, 7)
    graph.train(stored)
    graph.add(stored)
    data = graph.to_bytes()
    assert bytes(data) == bytes(faiss.serialize_index(graph._index))
    again = AnnIndex.from_bytes(data, DIMS, 7)
    assert again.count == graph.count == len(stored)
    rng = np.random.default_rng(3)
    for i in rng.choice(len(stored), 20, replace=False):
        query = edit(stored[i], rng, 0.3)
        assert np.array_equal(again.search(query, 7), graph.search(query, 7))
