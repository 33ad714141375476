"""The shared novelty memory in Redis's Query Engine, against real Redis 8 servers the tests
start: several RedisVectorMemory objects, each with its own connections, are replicas as far
as Redis can tell (docs/operating/scaling.md)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.core.config import ConfigError, redis_location
from app.memory.base import Comparison, MemoryUnavailableError, NamespaceLimitError, Vector
from app.memory.redis_vectors import RedisVectorMemory
from app.memory.ring import CacheEntries, exact_cosine
from app.service.cache_transfer import LineReader, export_lines
from tests.server import RedisCluster, RedisServer, refused_start

pytestmark = pytest.mark.redis

MODEL = "test-model"
#: Generous: these tests are about order and content, not about the timeout.
TIMEOUT_MS = 10_000
NS = "default"


def unit_vectors(n: int, seed: int, dimensions: int = 384) -> list[Vector]:
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((n, dimensions)).astype(np.float32)
    return list(v / np.linalg.norm(v, axis=1, keepdims=True))


def run(scenario: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    return asyncio.run(scenario())


def shared_memory(url: str, prefix: str, **settings: Any) -> RedisVectorMemory:
    """A replica's memory, not started: these tests' defaults, then `settings`."""
    options: dict[str, Any] = {
        "capacity": 1000,
        "ttl_ms": None,
        "timeout_ms": TIMEOUT_MS,
        "model": MODEL,
    } | settings
    return RedisVectorMemory(url, redis_location(url), prefix=prefix, **options)


@asynccontextmanager
async def replicas(
    url: str, prefix: str, count: int = 2, **settings: Any
) -> AsyncIterator[list[RedisVectorMemory]]:
    memories = [shared_memory(url, prefix, **settings) for _ in range(count)]
    for m in memories:
        await m.start()
    try:
        yield memories
    finally:
        for m in memories:
            await m.close()


def summary(c: Comparison) -> tuple[float | None, int, str | None]:
    """A comparison without the nearest entry's age (the replay has no clock)."""
    return c.max_cosine, c.size, None if c.nearest is None else c.nearest.trace_id


def replayed(
    stored: Sequence[tuple[str, Vector]], vectors: Sequence[Vector], trace_ids: Sequence[str]
) -> list[tuple[float | None, int, str | None]]:
    """One-at-a-time scoring: each vector against `stored` and the ones before it (exact, in
    float64; ties: the newest), then added."""
    memory = list(stored)
    out: list[tuple[float | None, int, str | None]] = []
    for vector, trace_id in zip(vectors, trace_ids, strict=True):
        best: tuple[float, str] | None = None
        for stored_id, stored_vector in memory:
            cosine = exact_cosine(vector, stored_vector)
            if best is None or cosine >= best[0]:
                best = (cosine, stored_id)
        out.append((None, 0, None) if best is None else (best[0], len(memory), best[1]))
        memory.append((trace_id, vector))
    return out


async def entries_of(memory: RedisVectorMemory, namespace: str = NS) -> list[tuple[str, Vector]]:
    """The namespace's entries, oldest first: (trace id, vector)."""
    out: list[tuple[str, Vector]] = []
    async for chunk in memory.export_chunks(namespace):
        out += zip(chunk.ids(), chunk.vectors, strict=True)
    return out


def test_a_vector_added_on_one_replica_is_seen_by_the_other(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    v = unit_vectors(2, seed=1)

    async def scenario() -> None:
        async with replicas(redis_server.url, redis_prefix) as (a, b):
            assert await a.compare(NS, [v[0]], ["t0"], add=True) == [
                Comparison(None, 0, stored=True)
            ]
            (seen,) = await b.compare(NS, [v[0]], ["t1"], add=True)
            assert (seen.size, seen.search, seen.stored) == (1, "exact", True)
            assert seen.max_cosine == pytest.approx(1.0, abs=1e-6)
            (third,) = await a.compare(NS, [v[1]], ["t2"], add=False)
            assert (third.size, third.stored) == (2, False)  # A sees B's add as well
            assert a.backend.shared
            assert a.backend.available
            assert "s3cret" not in (a.backend.location or "")
            assert [t for t, _ in await entries_of(a)] == ["t0", "t1"]

    run(scenario)


def test_concurrent_requests_over_replicas_equal_one_at_a_time_scoring(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    """Singles, batches and dry runs at once over three replicas; each answer must be what
    one-at-a-time scoring in the order Redis ran them gives."""
    pool = unit_vectors(40, seed=2)
    rng = np.random.default_rng(3)
    requests: list[tuple[list[Vector], list[str], bool]] = []
    for i in range(90):
        size = 3 if i % 5 == 0 else 1
        # Repeats of earlier vectors make some maxima 1.0 and others small: order shows.
        vectors = [pool[int(j)] for j in rng.integers(0, len(pool), size)]
        requests.append((vectors, [f"r{i}.{k}" for k in range(size)], i % 9 != 4))

    async def scenario() -> tuple[list[list[Comparison]], list[tuple[str, Vector]]]:
        async with replicas(redis_server.url, redis_prefix, count=3) as memories:
            answers = await asyncio.gather(
                *(
                    memories[i % 3].compare(NS, vectors, trace_ids, add=add)
                    for i, (vectors, trace_ids, add) in enumerate(requests)
                )
            )
            return answers, await entries_of(memories[0])

    answers, log = run(scenario)
    position = {trace_id: p for p, (trace_id, _) in enumerate(log)}
    assert len(log) == sum(len(r[0]) for r in requests if r[2])
    for (vectors, trace_ids, add), answer in zip(requests, answers, strict=True):
        if add:
            start = position[trace_ids[0]]
            # A batch's entries are consecutive in the order.
            assert [position[t] for t in trace_ids] == list(range(start, start + len(vectors)))
            assert all(c.stored for c in answer)
        else:
            assert not set(trace_ids) & set(position)  # a dry run adds nothing
            assert not any(c.stored for c in answer)
            start = answer[0].size  # the memory it saw
        assert replayed(log[:start], vectors, trace_ids) == [summary(c) for c in answer]


def test_namespaces_are_memories_of_their_own(redis_server: RedisServer, redis_prefix: str) -> None:
    v = unit_vectors(3, seed=12)

    async def scenario() -> None:
        async with replicas(redis_server.url, redis_prefix, capacity=2) as (a, b):
            await a.compare("net-a", v, ["a0", "a1", "a2"], add=True)
            # The same trace in another namespace is novel there.
            assert await b.compare("net-b", [v[0]], ["b0"], add=True) == [
                Comparison(None, 0, stored=True)
            ]
            (seen,) = await b.compare("net-a", [v[2]], ["probe"], add=False)
            assert seen.size == 2  # capacity holds per namespace: a0 was evicted there
            assert seen.max_cosine == pytest.approx(1.0, abs=1e-6)
            assert (await a.stats("net-b")).size == 1
            assert (await a.stats("net-a")).evictions_total == 1
            assert await a.namespaces() == ["net-a", "net-b"]
            assert await a.clear("net-a") == 2
            assert await b.namespaces() == ["net-b"]
            assert (await b.stats("net-b")).size == 1  # untouched by the other's clear
            assert (await b.stats("never-used")).size == 0

    run(scenario)


def test_a_namespace_past_the_limit_is_refused(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    v = unit_vectors(1, seed=13)

    async def scenario() -> None:
        async with replicas(redis_server.url, redis_prefix, max_namespaces=2) as (a, b):
            await a.compare("one", v, ["t"], add=True)
            await b.compare("two", v, ["t"], add=True)
            with pytest.raises(NamespaceLimitError, match="KP_MAX_NAMESPACES=2"):
                await a.compare("three", v, ["t"], add=True)
            # A dry run creates nothing, so it is answered.
            assert await b.compare("three", v, ["t"], add=False) == [Comparison(None, 0)]
            await a.clear("two")  # frees its place
            await b.compare("three", v, ["t"], add=True)
            assert await a.namespaces() == ["one", "three"]

    run(scenario)


def test_capacity_eviction_and_a_dry_run_at_capacity(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    v = unit_vectors(5, seed=4)

    async def scenario() -> None:
        async with replicas(redis_server.url, redis_prefix, capacity=3) as (a, b):
            await a.compare(NS, v[:2], ["a0", "a1"], add=True)
            second = await b.compare(NS, v[2:4], ["b0", "b1"], add=True)
            assert [c.size for c in second] == [2, 3]  # the fourth evicted the first
            stats = await a.stats(NS)
            assert (stats.size, stats.capacity) == (3, 3)
            assert (stats.adds_total, stats.evictions_total) == (4, 1)
            assert a.evictions_total == 0  # A has not seen B's add yet
            assert b.evictions_total == 1
            (oldest,) = await a.compare(NS, [v[0]], ["x"], add=False)
            assert oldest.max_cosine is not None
            assert oldest.max_cosine < 0.5
            # A dry run of two: the second is compared as if the first had been added, a1
            # (the oldest) evicted by it.
            first, then = await a.compare(NS, [v[4], v[1]], ["y", "z"], add=False)
            assert (first.size, then.size) == (3, 3)
            assert then.max_cosine is not None
            assert then.max_cosine < 0.5
            assert [t for t, _ in await entries_of(a)] == ["a1", "b0", "b1"]

    run(scenario)


def test_ttl_expires_entries_for_every_replica_on_redis_s_clock(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    v = unit_vectors(2, seed=5)

    async def scenario() -> None:
        async with replicas(redis_server.url, redis_prefix, ttl_ms=1500) as (a, b):
            await a.compare(NS, [v[0]], ["old"], add=True)
            await asyncio.sleep(1.6)
            (fresh,) = await b.compare(NS, [v[1]], ["new"], add=True)
            assert fresh == Comparison(None, 0, stored=True)  # A's entry expired first
            stats = await a.stats(NS)
            assert (stats.size, stats.ttl_ms) == (1, 1500)
            assert [t for t, _ in await entries_of(a)] == ["new"]

    run(scenario)
    with redis_server.client() as client:  # Redis dropped it
        assert not client.exists(f"{redis_prefix}{{{NS}}}:e:0")


def test_ties_name_the_newest_whatever_the_candidates(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    """Twenty copies of one vector: more than a search returns at first, so the script widens
    its search until the newest is among them."""
    (v,) = unit_vectors(1, seed=14)

    async def scenario() -> None:
        async with replicas(redis_server.url, redis_prefix, count=1) as (a,):
            await a.compare(NS, [v] * 20, [f"c{i}" for i in range(20)], add=True)
            (seen,) = await a.compare(NS, [v], ["probe"], add=False)
            assert seen.nearest is not None
            assert seen.nearest.trace_id == "c19"
            assert seen.search == "exact"

    run(scenario)


def test_a_namespace_moves_from_flat_to_hnsw_while_serving(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    """Past KP_REDIS_HNSW_FROM entries the namespace's HNSW index is built by Redis in the
    background; answers stay exact (FLAT) until it has every entry, then say `index`."""
    v = unit_vectors(120, seed=15)

    async def scenario() -> None:
        async with replicas(redis_server.url, redis_prefix, count=1, hnsw_from=50) as (a,):
            answers = await a.compare(NS, v[:60], [f"t{i}" for i in range(60)], add=True)
            assert {c.search for c in answers} == {"exact"}
            methods = []
            for i in range(60, 120):
                (c,) = await a.compare(NS, [v[i]], [f"t{i}"], add=True)
                methods.append(c.search)
                if c.search == "index":
                    break
            # Redis builds the index in the background, as fast as this machine goes: ask
            # until it answers (the deadline only stops a broken test).
            deadline = asyncio.get_running_loop().time() + 120
            while methods[-1] != "index" and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
                (c,) = await a.compare(NS, [v[60]], ["wait"], add=False)
                methods.append(c.search)
            assert methods[-1] == "index"
            assert set(methods) <= {"exact", "index"}
            (again,) = await a.compare(NS, [v[10]], ["probe"], add=False)
            assert again.search == "index"
            assert again.nearest is not None
            assert again.nearest.trace_id == "t10"
            assert again.max_cosine == pytest.approx(1.0, abs=1e-6)
            # A clear takes the namespace back to FLAT.
            await a.clear(NS)
            (fresh,) = await a.compare(NS, [v[0]], ["t0"], add=True)
            (exact,) = await a.compare(NS, [v[0]], ["t1"], add=True)
            assert (fresh.max_cosine, exact.search) == (None, "exact")

    run(scenario)


def test_replicas_with_other_settings_or_model_are_refused_until_a_clear(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    v = unit_vectors(1, seed=8)
    url = redis_server.url

    async def scenario() -> None:
        async with (
            replicas(url, redis_prefix, count=1) as (a,),
            replicas(url, redis_prefix, count=1, capacity=5) as (small,),
            replicas(url, redis_prefix, count=1, model="other-model") as (other,),
        ):
            await a.compare(NS, v, ["a"], add=True)
            for wrong, words in ((small, "KP_CACHE_CAPACITY=1000"), (other, "other-model")):
                with pytest.raises(MemoryUnavailableError, match=words):
                    await wrong.compare(NS, v, ["x"], add=True)
                assert not wrong.backend.available
                assert words in (wrong.backend.reason or "")
            assert (await a.stats(NS)).size == 1  # nothing of theirs was added
            # A clear from a replica gives the namespace its settings.
            assert await small.clear(NS) == 1
            assert await small.compare(NS, v, ["s"], add=True) == [Comparison(None, 0, stored=True)]
            with pytest.raises(MemoryUnavailableError, match="KP_CACHE_CAPACITY=5"):
                await a.compare(NS, v, ["a2"], add=True)

    run(scenario)


def test_a_redis_without_the_query_engine_is_refused_at_start(tmp_path: Path) -> None:
    plain = RedisServer(tmp_path, query_engine=False)

    async def scenario() -> None:
        memory = shared_memory(plain.url, "kp:")
        try:
            with pytest.raises(ConfigError) as refused:
                await memory.start()
        finally:
            await memory.close()
        message = str(refused.value)
        assert "\n" not in message
        assert "KP_REDIS_URL" in message
        assert "Query Engine" in message

    try:
        run(scenario)
        # The service itself: one line on stderr, before it serves, and exit status 1.
        env = dict(os.environ, KP_EMBEDDER="none", KP_REDIS_URL=plain.url)
        refusal = refused_start(env)
    finally:
        plain.stop()
    assert "KP_REDIS_URL" in refusal
    assert "Query Engine" in refusal


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_redis_down_at_start_then_back(tmp_path: Path) -> None:
    redis = RedisServer(tmp_path)
    redis.stop()
    v = unit_vectors(1, seed=9)

    async def scenario() -> None:
        async with replicas(redis.url, "kp:", count=1) as (memory,):
            assert not memory.backend.available
            assert "ConnectionError" in (memory.backend.reason or "")
            assert memory.health().degraded
            for _ in range(5):
                with pytest.raises(MemoryUnavailableError, match=r"127\.0\.0\.1"):
                    await memory.compare(NS, v, ["t"], add=True)
            assert (await memory.stats(NS)).size == 0  # GET /cache: the last view, no 503
            redis.start()
            for _ in range(600):  # the probe reconnects by itself
                if memory.backend.available:
                    break
                await asyncio.sleep(0.05)
            assert memory.backend.available
            assert await memory.compare(NS, v, ["t"], add=True) == [
                Comparison(None, 0, stored=True)
            ]
            assert memory.backend.outages_total == 1

    # Once logging is set up the app's loggers do not propagate (app/core/logging.py): listen
    # on the logger itself.
    logger, records = logging.getLogger("app.memory.redis_vectors"), _Records()
    logger.addHandler(records)
    try:
        run(scenario)
    finally:
        logger.removeHandler(records)
        redis.stop()
    messages = records.messages
    assert sum(m.startswith("shared cache unavailable") for m in messages) == 1
    assert sum(m.startswith("shared cache available again") for m in messages) == 1


def test_a_redis_that_does_not_answer_costs_a_request_the_timeout_only(tmp_path: Path) -> None:
    """SIGSTOP: connections stay open and nothing answers, the worst case for a client."""
    redis = RedisServer(tmp_path)
    v = unit_vectors(1, seed=10)

    async def scenario() -> None:
        async with replicas(redis.url, "kp:", count=1, timeout_ms=300) as (memory,):
            await memory.compare(NS, v, ["t0"], add=True)
            assert redis.process is not None
            redis.process.send_signal(signal.SIGSTOP)
            try:
                with pytest.raises(MemoryUnavailableError, match="KP_REDIS_TIMEOUT_MS"):
                    await memory.compare(NS, v, ["t1"], add=True)
                with pytest.raises(MemoryUnavailableError):  # at once, while it is out
                    await memory.compare(NS, v, ["t2"], add=True)
            finally:
                redis.process.send_signal(signal.SIGCONT)
            for _ in range(600):
                if memory.backend.available:
                    break
                await asyncio.sleep(0.05)
            (seen,) = await memory.compare(NS, v, ["t3"], add=False)
            # t1 may have reached Redis before the timeout (its answer said unavailable);
            # t2 never left this process.
            assert seen.size in (1, 2)

    try:
        run(scenario)
    finally:
        redis.stop()


def test_acknowledged_adds_survive_kill_9_of_redis(tmp_path: Path) -> None:
    redis = RedisServer(tmp_path)
    v = unit_vectors(20, seed=11)

    async def scenario(before_kill: bool) -> list[str]:
        async with replicas(redis.url, "kp:", count=1) as (memory,):
            if before_kill:
                for i, vector in enumerate(v):
                    await memory.compare(NS, [vector], [f"t{i}"], add=True)
            else:
                assert (await memory.stats(NS)).size == len(v)
                (seen,) = await memory.compare(NS, [v[7]], ["probe"], add=False)
                assert seen.max_cosine == pytest.approx(1.0, abs=1e-6)
                assert seen.nearest is not None
                assert seen.nearest.trace_id == "t7"
            return [t for t, _ in await entries_of(memory)]

    try:
        run(lambda: scenario(True))
        redis.stop(signal.SIGKILL)
        redis.start()  # replays its append-only file, and the index is made again from it
        assert run(lambda: scenario(False)) == [f"t{i}" for i in range(20)]
    finally:
        redis.stop()


def test_an_export_of_the_stream_based_shared_mode_imports(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    """tests/fixtures/stream-shared-export.ndjson: GET /cache/export of the shared memory
    before it moved into the Query Engine (a Redis stream mirrored by every replica), with
    the examples/ traces scored by the real model. Imported, it answers as it did there."""
    body = (Path(__file__).parent / "fixtures" / "stream-shared-export.ndjson").read_bytes()

    async def scenario() -> None:
        reader = LineReader(384)
        reader.feed(body)
        entries = reader.finish()
        async with replicas(redis_server.url, redis_prefix, count=1) as (memory,):
            assert await memory.import_entries(NS, entries) == (len(entries.vectors), 0)
            stored = await entries_of(memory)
            assert [t for t, _ in stored] == list(entries.ids())
            exported = b"".join(export_lines([c async for c in memory.export_chunks(NS)]))
            assert exported == body  # times, ids and vectors bit for bit
            (seen,) = await memory.compare(NS, [entries.vectors[2]], ["probe"], add=False)
            assert seen.nearest is not None
            assert seen.nearest.trace_id == entries.ids()[2]

    run(scenario)


# ── a Redis Cluster ──────────────────────────────────────────────────────────────────


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    nodes = RedisCluster(tmp_path_factory.mktemp("cluster"))
    yield nodes
    nodes.stop()


def test_namespaces_spread_over_a_three_node_cluster_each_in_its_order(
    cluster: RedisCluster,
) -> None:
    prefix = "kp:"
    # Namespace names whose hash tags land on each of the three nodes.
    names: dict[int, list[str]] = {0: [], 1: [], 2: []}
    for i in range(60):
        name = f"tenant-{i}"
        node = cluster.nodes.index(cluster.node_of(f"{prefix}{{{name}}}:meta"))
        if len(names[node]) < 2:
            names[node].append(name)
    chosen = [n for ns in names.values() for n in ns]
    assert len(chosen) == 6
    v = unit_vectors(8, seed=16)

    async def scenario() -> dict[str, list[tuple[str, Vector]]]:
        async with replicas(cluster.url, prefix, count=2) as (a, b):
            work = []
            for k, name in enumerate(chosen):
                for j in range(4):
                    replica = (a, b)[(k + j) % 2]
                    trace_ids = [f"{name}.{j}.0", f"{name}.{j}.1"]
                    work.append(
                        (
                            name,
                            trace_ids,
                            replica.compare(name, v[2 * j : 2 * j + 2], trace_ids, add=True),
                        )
                    )
            answers = await asyncio.gather(*(w[2] for w in work))
            logs = {name: await entries_of(a, name) for name in chosen}
            for (name, trace_ids, _), answer in zip(work, answers, strict=True):
                log = [t for t, _ in logs[name]]
                start = log.index(trace_ids[0])
                assert log[start : start + 2] == trace_ids
                expected = replayed(logs[name][:start], v_of(trace_ids, v), trace_ids)
                assert [summary(c) for c in answer] == expected
            assert await b.namespaces() == sorted(chosen)
            return logs

    logs = run(scenario)
    for name in chosen:
        assert len(logs[name]) == 8
        node = cluster.node_of(f"{prefix}{{{name}}}:meta")
        with node.client() as client:  # the namespace's keys and index live on its node
            assert client.exists(f"{prefix}{{{name}}}:meta")
            assert f"{prefix}idx:{{{name}}}".encode() in client.execute_command("FT._LIST")


def v_of(trace_ids: Sequence[str], pool: Sequence[Vector]) -> list[Vector]:
    """The vectors a cluster test's trace ids name (`<ns>.<j>.<k>`: pool[2j + k])."""
    out = []
    for trace_id in trace_ids:
        _, j, k = trace_id.rsplit(".", 2)
        out.append(pool[2 * int(j) + int(k)])
    return out


def test_entries_of_an_import_keep_their_order_and_times(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    v = unit_vectors(3, seed=17)
    times = np.array([1_000.0, 3_000.0, 2_000.0])  # the third raised to the second's

    async def scenario() -> None:
        async with replicas(redis_server.url, redis_prefix, count=1) as (a,):
            entries = CacheEntries(np.stack(v), times, ["x", "y", "z"])
            assert await a.import_entries(NS, entries) == (3, 0)
            (chunk,) = [c async for c in a.export_chunks(NS)]
            assert list(chunk.added_at_ms) == [1_000.0, 3_000.0, 3_000.0]
            assert list(chunk.ids()) == ["x", "y", "z"]

    run(scenario)


# ── a replica holds no copy ──────────────────────────────────────────────────────────


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.server
@pytest.mark.slow
def test_a_replica_s_memory_does_not_grow_with_the_shared_memory(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    """A replica with the real model scores dry runs against 1,000 entries, then against
    100,000 loaded straight into Redis (the memory's own import, 150 MB of vectors): its
    resident memory stays where it was, and it was ready at once both times."""
    from tests.factories import TOPICS, make_trace
    from tests.server import LiveServer

    capacity = 100_000
    env = {
        "KP_EMBEDDER": "onnx",
        "KP_EMBEDDER_PRELOAD": "true",
        "KP_EMBEDDER_WORKERS": "1",
        "KP_LOG_LEVEL": "warning",
        "KP_REDIS_URL": redis_server.url,
        "KP_REDIS_PREFIX": redis_prefix,
        "KP_REDIS_TIMEOUT_MS": "10000",
        "KP_CACHE_CAPACITY": str(capacity),
        "KP_REDIS_HNSW_FROM": "0",  # FLAT: the test is about the replica, not the index
    }
    rng = np.random.default_rng(18)

    async def load(count: int) -> None:
        # No model named: the namespace takes the replica's at its first step.
        async with replicas(
            redis_server.url, redis_prefix, count=1, capacity=capacity, model=None, hnsw_from=0
        ) as (m,):
            for first in range(0, count, 10_000):
                rows = rng.standard_normal((10_000, 384)).astype(np.float32)
                rows /= np.linalg.norm(rows, axis=1, keepdims=True)
                ids = [f"kp:trace:load-{first + i}" for i in range(10_000)]
                times = np.full(10_000, 1e12)
                await m.import_entries(NS, CacheEntries(rows[: count - first], times, ids))

    def dry_runs(replica: LiveServer) -> None:
        for i in range(10):
            r = replica.client.post(
                "/evaluate",
                json=make_trace(objective=f"{TOPICS[i % len(TOPICS)]}, case {i}"),
                params={"dry_run": "true"},
            )
            assert r.status_code == 200, r.text
            assert r.json()["novelty"]["measured"] is True

    run(lambda: load(1_000))
    replica = LiveServer(env, tmp_path / "replica.log")
    try:
        ready = replica.client.get("/readyz").json()
        assert ready["status"] == "ready", ready
        dry_runs(replica)
        small = _rss_mb(replica.process.pid)
        run(lambda: load(capacity - 1_000))
        assert replica.client.get("/readyz").json()["cache_size"] >= 1_000
        dry_runs(replica)
        large = _rss_mb(replica.process.pid)
        stats = replica.client.get("/cache", headers={"Authorization": "Bearer none"})
        assert stats.status_code in (200, 401)
    finally:
        replica.stop()
    # A copy would be 150 MB or more; allocator noise is a few MB.
    assert large - small < 30, (small, large)
    late = LiveServer(env, tmp_path / "late.log")
    try:  # a new replica is ready at once: there is nothing to load
        assert late.client.get("/readyz").json()["status"] == "ready"
    finally:
        late.stop()


def test_a_retired_index_setting_is_named_with_what_took_its_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from app.core.config import Settings, retired_settings

    monkeypatch.setenv("KP_CACHE_INDEX_THRESHOLD", "20000")
    monkeypatch.setenv("KP_CACHE_SEARCH", "exact")
    Settings.from_env()  # the start goes on
    lines = retired_settings()
    assert len(lines) == 2
    assert any(
        line.startswith("KP_CACHE_INDEX_THRESHOLD is no longer read")
        and "KP_REDIS_HNSW_FROM" in line
        for line in lines
    )


def test_a_large_clear_deletes_in_batches_while_others_go_on(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    """25,000 entries: the clear empties the namespace for every request at once, and its keys
    go a batch a run, with another replica's adds in between; none of the old ones remain."""
    rng = np.random.default_rng(19)
    rows = rng.standard_normal((25_000, 384)).astype(np.float32)
    v = unit_vectors(8, seed=20)

    async def scenario() -> None:
        async with replicas(redis_server.url, redis_prefix, capacity=30_000, hnsw_from=0) as (a, b):
            ids = [f"kp:trace:old-{i}" for i in range(len(rows))]
            await a.import_entries(NS, CacheEntries(rows, np.full(len(rows), 1e12), ids))

            async def adds() -> list[list[Comparison]]:
                out = []
                for i, vector in enumerate(v):
                    out.append(await b.compare(NS, [vector], [f"new-{i}"], add=True))
                return out

            cleared, answers = await asyncio.gather(a.clear(NS), adds())
            assert cleared == 25_000
            log = await entries_of(a)
            assert all(t.startswith("new-") for t, _ in log)  # nothing old is seen
            assert len(log) <= len(v)
            for answer in answers:
                assert answer[0].stored
        with redis_server.client() as client:
            keys = list(client.scan_iter(match=f"{redis_prefix}{{{NS}}}:e:*", count=10_000))
        assert len(keys) == len(log)  # the old keys are all deleted

    run(scenario)


# ── an operator's mistakes, a hostile neighbour ─────────────────────────────────────


def _flat_index(client: Any, name: str, prefix: str, *params: str) -> None:
    """FT.CREATE of a FLAT index someone else made: `params` after the vector's TYPE."""
    client.execute_command(
        "FT.CREATE", name, "ON", "HASH", "PREFIX", "1", prefix, "SCHEMA",
        "seq", "NUMERIC", "v", "VECTOR", "FLAT", str(2 + len(params)), "TYPE", "FLOAT32",
        *params,
    )  # fmt: skip


async def _until_answered(
    memory: RedisVectorMemory, namespace: str, vector: Vector, tid: str
) -> Comparison:
    """The namespace's first answer once it answers again (Redis indexes in the background)."""
    for _ in range(600):
        try:
            (answer,) = await memory.compare(namespace, [vector], [tid], add=True)
            return answer
        except MemoryUnavailableError:
            await asyncio.sleep(0.05)
    raise AssertionError(f"namespace {namespace} never answered again")


def test_a_dropped_index_affects_its_namespace_alone_and_is_made_again(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    """FT.DROPINDEX of one namespace's index: that namespace is refused (saying which index)
    while Redis indexes its entries again, every other answers as usual, and it answers
    again with no restart, having lost nothing."""
    v = unit_vectors(40, seed=30)

    async def scenario() -> None:
        async with replicas(redis_server.url, redis_prefix, count=2) as (a, b):
            for i in range(10):
                await a.compare("victim", [v[i]], [f"v{i}"], add=True)
                await a.compare("normal", [v[10 + i]], [f"n{i}"], add=True)
            with redis_server.client() as client:
                client.execute_command("FT.DROPINDEX", f"{redis_prefix}idx:{{victim}}")
            with pytest.raises(MemoryUnavailableError, match=rf"{redis_prefix}idx:\{{victim\}}"):
                await b.compare("victim", [v[20]], ["refused"], add=True)
            assert b.backend.available  # the replica is
            assert b.health().degraded
            assert any("'victim'" in w and "idx:{victim}" in w for w in b.health().warnings)
            assert b.faults.namespaces_unavailable == 1
            assert b.faults.index_rebuilds_total == 1
            for i in range(15):  # the others are untouched
                (seen,) = await b.compare("normal", [v[21 + i]], [f"n{10 + i}"], add=True)
                assert seen.stored
            again = await _until_answered(b, "victim", v[3], "v-again")
            assert again.stored
            assert again.max_cosine == pytest.approx(1.0, abs=1e-6)
            assert again.nearest is not None
            assert again.nearest.trace_id == "v3"
            assert b.faults.namespaces_unavailable == 0
            assert not b.health().degraded
            # A's step meets the index made again (its check is the script's, not A's).
            (on_a,) = await a.compare("victim", [v[5]], ["v-a"], add=True)
            assert on_a.nearest is not None
            assert on_a.nearest.trace_id == "v5"
            entries = [t for t, _ in await entries_of(a, "victim")]
            assert entries == [f"v{i}" for i in range(10)] + ["v-again", "v-a"]

    run(scenario)


@pytest.mark.parametrize(
    ("params", "why"),
    [
        (("DIM", "128", "DISTANCE_METRIC", "COSINE"), "its dim is 128, not 384"),
        (("DIM", "384", "DISTANCE_METRIC", "L2"), "its distance metric is L2, not COSINE"),
        ("prefix", "its key prefix is other:, not"),
    ],
)
def test_an_index_someone_else_made_is_never_used(
    redis_server: RedisServer, redis_prefix: str, params: Any, why: str
) -> None:
    """An index of the namespace's name made by someone else (another dimension, metric or
    prefix) before the namespace: refused with the reason, nothing added, the others fine;
    once it is dropped, the namespace answers with no restart."""
    v = unit_vectors(3, seed=31)
    index = f"{redis_prefix}idx:{{victim}}"
    with redis_server.client() as client:
        if params == "prefix":
            _flat_index(client, index, "other:", "DIM", "384", "DISTANCE_METRIC", "COSINE")
        else:
            _flat_index(client, index, f"{redis_prefix}{{victim}}:e:", *params)

    async def scenario() -> None:
        async with replicas(redis_server.url, redis_prefix, count=1) as (memory,):
            for _ in range(3):  # the same trace three times: never "stored" into nothing
                with pytest.raises(MemoryUnavailableError) as refused:
                    await memory.compare("victim", [v[0]], ["t0"], add=True)
                assert index in str(refused.value)
                assert why in str(refused.value)
            assert (await memory.stats("victim")).size == 0
            assert await memory.compare("normal", [v[1]], ["n0"], add=True) == [
                Comparison(None, 0, stored=True)
            ]
            assert any(why in w for w in memory.health().warnings)
            with redis_server.client() as client:
                client.execute_command("FT.DROPINDEX", index)
            await asyncio.sleep(0)
            (first,) = await memory.compare("victim", [v[0]], ["t0"], add=True)
            (second,) = await memory.compare("victim", [v[0]], ["t1"], add=True)
            assert first.stored
            assert first.max_cosine is None
            assert second.max_cosine == pytest.approx(1.0, abs=1e-6)
            assert not memory.health().warnings

    run(scenario)


def test_an_index_swapped_for_another_s_while_serving_is_refused(tmp_path: Path) -> None:
    """The namespace's index dropped and made again by someone else (another dimension)
    after this replica checked it: its next search finds nothing, the index is checked, and
    the namespace is refused. Once that index is dropped the namespace answers again; after
    kill -9 of Redis every trace answered as stored is there."""
    redis = RedisServer(tmp_path)
    v = unit_vectors(6, seed=32)
    index = "kp:idx:{victim}"
    stored: list[str] = []

    async def scenario() -> None:
        async with replicas(redis.url, "kp:", count=1) as (memory,):
            for i in range(2):
                (c,) = await memory.compare("victim", [v[i]], [f"t{i}"], add=True)
                assert c.stored
                stored.append(f"t{i}")
            with redis.client() as client:
                client.execute_command("FT.DROPINDEX", index)
                _flat_index(client, index, "kp:{victim}:e:", "DIM", "128",
                            "DISTANCE_METRIC", "COSINE")  # fmt: skip
            with pytest.raises(MemoryUnavailableError, match="its dim is 128"):
                await memory.compare("victim", [v[2]], ["t2"], add=True)
            assert [t for t, _ in await entries_of(memory, "victim")] == stored
            with redis.client() as client:
                client.execute_command("FT.DROPINDEX", index)
            again = await _until_answered(memory, "victim", v[0], "t3")
            assert again.stored
            assert again.nearest is not None
            assert again.nearest.trace_id == "t0"
            stored.append("t3")

    async def after_kill() -> list[str]:
        async with replicas(redis.url, "kp:", count=1) as (memory,):
            return [t for t, _ in await entries_of(memory, "victim")]

    try:
        run(scenario)
        redis.stop(signal.SIGKILL)
        redis.start()
        assert run(after_kill) == stored
    finally:
        redis.stop()


def test_a_clear_makes_a_dropped_index_again(redis_server: RedisServer, redis_prefix: str) -> None:
    """DELETE /cache of a namespace whose index went: the namespace answers at once after."""
    v = unit_vectors(3, seed=35)

    async def scenario() -> None:
        async with replicas(redis_server.url, redis_prefix, count=1) as (memory,):
            await memory.compare("victim", v[:2], ["t0", "t1"], add=True)
            with redis_server.client() as client:
                client.execute_command("FT.DROPINDEX", f"{redis_prefix}idx:{{victim}}")
            assert await memory.clear("victim") == 2
            (fresh,) = await memory.compare("victim", [v[2]], ["t2"], add=True)
            (seen,) = await memory.compare("victim", [v[2]], ["t3"], add=True)
            assert fresh.stored
            assert fresh.max_cosine is None
            assert seen.max_cosine == pytest.approx(1.0, abs=1e-6)

    run(scenario)


def test_an_evicting_maxmemory_policy_stores_nothing_until_it_is_noeviction(
    tmp_path: Path,
) -> None:
    """CONFIG SET maxmemory-policy allkeys-lru while serving: read within the watch's
    interval, and from then on each trace is compared but answered as not stored, with the
    reason; an import is refused. Back to noeviction: stored again, no restart."""
    from app.memory import redis_vectors

    redis = RedisServer(tmp_path)
    v = unit_vectors(4, seed=33)

    async def scenario() -> None:
        async with replicas(redis.url, "kp:", count=1) as (memory,):
            assert (await memory.compare(NS, [v[0]], ["t0"], add=True))[0].stored
            with redis.client() as client:
                client.config_set("maxmemory-policy", "allkeys-lru")
            await _until(lambda: memory.faults.eviction_unsafe)
            (refused,) = await memory.compare(NS, [v[0]], ["t1"], add=True)
            assert not refused.stored
            assert refused.max_cosine == pytest.approx(1.0, abs=1e-6)  # still measured
            assert "maxmemory-policy allkeys-lru" in (refused.not_stored or "")
            assert any("allkeys-lru" in w for w in memory.health().warnings)
            assert memory.faults.not_stored_total == 1
            with pytest.raises(MemoryUnavailableError, match="allkeys-lru"):
                await memory.import_entries(
                    NS, CacheEntries(np.stack(v[2:3]), np.array([1e12]), ["i"])
                )
            with redis.client() as client:
                client.config_set("maxmemory-policy", "noeviction")
            await _until(lambda: not memory.faults.eviction_unsafe)
            assert (await memory.compare(NS, [v[3]], ["t3"], add=True))[0].stored
            assert [t for t, _ in await entries_of(memory)] == ["t0", "t3"]

    assert redis_vectors.WATCH_INTERVAL_S <= 5
    try:
        run(scenario)
        # Read at the connect too: a replica started under allkeys-lru stores nothing.
        with redis.client() as client:
            client.config_set("maxmemory-policy", "allkeys-lfu")

        async def started_under_it() -> None:
            async with replicas(redis.url, "kp:", count=1) as (memory,):
                assert memory.faults.eviction_unsafe
                assert not (await memory.compare(NS, [v[1]], ["late"], add=True))[0].stored

        run(started_under_it)
    finally:
        redis.stop()


async def _until(condition: Callable[[], bool], patience_s: float = 60.0) -> None:
    for _ in range(int(patience_s / 0.05)):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("not within the patience")


def test_expired_namespaces_are_let_go_and_no_longer_count(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    """Three namespaces at KP_MAX_NAMESPACES=3 expire: a fourth is admitted, and the expired
    ones' keys, indexes and registry places are gone (the memory given back)."""
    v = unit_vectors(4, seed=34)

    async def scenario() -> None:
        async with replicas(
            redis_server.url, redis_prefix, count=2, ttl_ms=300, max_namespaces=3
        ) as (a, b):
            for i, ns in enumerate(("one", "two", "three")):
                await a.compare(ns, [v[i]], [ns], add=True)
            with pytest.raises(NamespaceLimitError):
                await b.compare("four", [v[3]], ["four"], add=True)
            await asyncio.sleep(0.4)
            assert (await b.compare("four", [v[3]], ["four"], add=True))[0].stored
            with redis_server.client() as client:
                assert {m.decode() for m in client.smembers(f"{redis_prefix}namespaces")} == {
                    "four"
                }
                left = list(client.scan_iter(match=f"{redis_prefix}{{one}}*"))
                assert left == []
                indexes = {i.decode() for i in client.execute_command("FT._LIST")}
                assert f"{redis_prefix}idx:{{one}}" not in indexes
                assert f"{redis_prefix}idx:{{four}}" in indexes
            assert a.evictions_total == 0

    run(scenario)


# ── the same, through a live replica: answers, /readyz, /metrics, kill -9 of Redis ──


def _replica(redis: RedisServer, log: Path, **env: str) -> Any:
    from tests.server import TOKEN, LiveServer

    return LiveServer(
        {
            "KP_EMBEDDER": "onnx",
            "KP_EMBEDDER_PRELOAD": "true",
            "KP_EMBEDDER_WORKERS": "1",
            "KP_LOG_LEVEL": "warning",
            "KP_REDIS_URL": redis.url,
            "KP_ADMIN_TOKEN": TOKEN,
            **env,
        },
        log,
    )


class _Traces:
    """POSTs to a replica, one trace at a time, counting what each answer says was stored."""

    def __init__(self, replica: Any) -> None:
        self.replica = replica
        self.stored: dict[str, list[str]] = {}
        self.count = 0

    def post(self, namespace: str) -> dict[str, Any]:
        from tests.factories import make_trace

        self.count += 1
        trace = make_trace(
            trace_id=f"kp:trace:{namespace}-{self.count}",
            objective=f"{namespace} topic number {self.count}",
        )
        r = self.replica.client.post("/evaluate", json=trace, headers={"KP-Namespace": namespace})
        assert r.status_code == 200, r.text
        novelty: dict[str, Any] = r.json()["novelty"]
        if novelty["stored"]:
            self.stored.setdefault(namespace, []).append(trace["id"])
        return novelty

    def readyz(self) -> dict[str, Any]:
        ready: dict[str, Any] = self.replica.client.get("/readyz").json()
        return ready

    def metric(self, name: str) -> float:
        for line in self.replica.client.get("/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"no {name}")

    def exported(self, namespace: str) -> list[str]:
        import orjson

        from tests.server import TOKEN

        for _ in range(600):  # after a Redis restart: until the replica is back
            r = self.replica.client.get(
                "/cache/export",
                headers={"KP-Namespace": namespace, "Authorization": f"Bearer {TOKEN}"},
            )
            if r.status_code == 200:
                return [orjson.loads(line)["trace_id"] for line in r.text.splitlines()]
            import time

            time.sleep(0.05)
        raise AssertionError(f"no export of {namespace}")


def _wait(condition: Callable[[], bool], patience_s: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + patience_s
    while not condition():
        assert time.monotonic() < deadline, "not within the patience"
        time.sleep(0.1)


@pytest.mark.server
def test_a_dropped_index_through_a_replica_then_kill_9_of_redis(tmp_path: Path) -> None:
    """FT.DROPINDEX kp:idx:{victim} under a live replica, requests alternating with another
    namespace: the other is never refused, the victim is refused with the index named in the
    answer, /readyz and the metrics until it is rebuilt, then answers with no restart. After
    kill -9 of Redis and its restart, every trace answered as stored is there."""
    (tmp_path / "redis").mkdir()
    redis = RedisServer(tmp_path / "redis")
    replica = _replica(redis, tmp_path / "replica.log")
    traces = _Traces(replica)
    try:
        for _ in range(5):
            assert traces.post("victim")["stored"]
            assert traces.post("normal")["stored"]
        with redis.client() as client:
            client.execute_command("FT.DROPINDEX", "kp:idx:{victim}")
        refused = traces.post("victim")
        assert (refused["stored"], refused["reason"]) == (False, "cache_unavailable")
        assert "kp:idx:{victim}" in refused["detail"]
        ready = traces.readyz()
        assert ready["degraded"]
        assert ready["cache_backend"]["available"]
        assert any("'victim'" in w and "kp:idx:{victim}" in w for w in ready["warnings"])
        assert traces.metric("kp_cache_index_rebuilds_total") == 1
        for _ in range(15):
            assert traces.post("normal")["stored"]
            traces.post("victim")
        _wait(lambda: traces.post("victim")["stored"])
        assert traces.metric("kp_cache_namespaces_unavailable") == 0
        assert not traces.readyz()["degraded"]
        redis.stop(signal.SIGKILL)
        redis.start()
        for namespace in ("victim", "normal"):
            assert traces.exported(namespace) == traces.stored[namespace]
    finally:
        replica.stop()
        redis.stop()


@pytest.mark.server
def test_an_evicting_policy_through_a_replica_then_kill_9_of_redis(tmp_path: Path) -> None:
    """CONFIG SET maxmemory-policy allkeys-lru under a live replica: within the watch's
    interval /readyz warns and the metric says so, and every answer says not stored (with the
    reason) while novelty is still measured; back to noeviction, stored again with no
    restart. After kill -9 of Redis, every trace answered as stored is there."""
    (tmp_path / "redis").mkdir()
    redis = RedisServer(tmp_path / "redis")
    replica = _replica(redis, tmp_path / "replica.log")
    traces = _Traces(replica)
    try:
        assert all(traces.post("default")["stored"] for _ in range(5))
        with redis.client() as client:
            client.config_set("maxmemory-policy", "allkeys-lru")
        _wait(lambda: any("allkeys-lru" in w for w in traces.readyz()["warnings"]))
        assert traces.metric("kp_cache_eviction_unsafe") == 1
        for _ in range(5):
            novelty = traces.post("default")
            assert (novelty["stored"], novelty["not_stored"]) == (False, "storage_failed")
            assert novelty["measured"]
            assert "allkeys-lru" in novelty["not_stored_detail"]
        assert traces.metric("kp_cache_not_stored_total") == 5
        with redis.client() as client:
            client.config_set("maxmemory-policy", "noeviction")
        _wait(lambda: not traces.readyz()["warnings"])
        assert traces.metric("kp_cache_eviction_unsafe") == 0
        assert all(traces.post("default")["stored"] for _ in range(5))
        redis.stop(signal.SIGKILL)
        redis.start()
        assert traces.exported("default") == traces.stored["default"]
        assert len(traces.stored["default"]) == 10
    finally:
        replica.stop()
        redis.stop()
