"""The shared novelty memory against a real redis-server: several RedisSharedMemory objects,
each with its own connections, are replicas as far as Redis can tell (docs/operating/scaling.md)."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from redis.asyncio import Redis as AsyncRedis

from app.core.config import ConfigError, Settings, redis_location
from app.domain.vector_cache import CacheEntries, VectorCache
from app.store.base import DEFAULT_NAMESPACE as NS
from app.store.base import Comparison, MemoryUnavailableError, Vector
from app.store.in_process import compare_in_order
from app.store.redis_shared import PAGE, RedisSharedMemory
from tests.conftest import ClientFactory
from tests.factories import make_trace
from tests.server import RedisServer, free_port

MODEL = "test-model"
#: Generous: these tests are about order and content, not about the timeout.
TIMEOUT_MS = 10_000


def unit_vectors(n: int, seed: int) -> list[Vector]:
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((n, 384)).astype(np.float32)
    return list(v / np.linalg.norm(v, axis=1, keepdims=True))


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


def shared_memory(redis: RedisServer, prefix: str, **settings: Any) -> RedisSharedMemory:
    """A replica's memory, not started: these tests' defaults, then `settings`."""
    options: dict[str, Any] = {
        "capacity": 1000,
        "ttl_ms": None,
        "timeout_ms": TIMEOUT_MS,
        "model": MODEL,
    } | settings
    return RedisSharedMemory(redis.url, redis_location(redis.url), prefix=prefix, **options)


@asynccontextmanager
async def replicas(
    redis: RedisServer, prefix: str, count: int = 2, **settings: Any
) -> AsyncIterator[list[RedisSharedMemory]]:
    memories = [shared_memory(redis, prefix, **settings) for _ in range(count)]
    for m in memories:
        await m.start()
    try:
        yield memories
    finally:
        for m in memories:
            await m.close()


def summary(c: Comparison) -> tuple[float | None, int, str | None]:
    """A comparison without the nearest entry's age (the replay has no clock of its own)."""
    return c.max_cosine, c.size, None if c.nearest is None else c.nearest.trace_id


def log_entries(redis: RedisServer, prefix: str) -> list[tuple[str, Vector]]:
    """The shared log, oldest first: (trace id, vector)."""
    with redis.client() as client:
        entries = client.xrange(f"{prefix}novelty:log")
    return [
        (fields[b"trace"].decode(), np.frombuffer(fields[b"v"], dtype="<f4").astype(np.float32))
        for _, fields in entries
    ]


def ids(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def test_a_vector_added_on_one_replica_is_seen_by_the_other(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    v = unit_vectors(2, seed=1)

    async def scenario() -> None:
        async with replicas(redis_server, redis_prefix) as (a, b):
            assert await a.compare(NS, [v[0]], ["t0"], add=True) == [
                Comparison(None, 0, stored=True)
            ]
            (seen,) = await b.compare(NS, [v[0]], ["t1"], add=True)
            assert seen.size == 1
            assert seen.max_cosine == pytest.approx(1.0, abs=1e-6)
            (third,) = await a.compare(NS, [v[1]], ["t2"], add=False)
            assert third.size == 2  # A sees B's add as well
            assert a.backend.shared
            assert a.backend.available
            assert "s3cret" not in (a.backend.location or "")

    run(scenario)
    assert [t for t, _ in log_entries(redis_server, redis_prefix)] == ["t0", "t1"]


@pytest.mark.parametrize("large", [False, True], ids=["small mirror", "mirror past threshold"])
def test_concurrent_requests_over_replicas_equal_the_order_of_the_log(
    redis_server: RedisServer, redis_prefix: str, large: bool
) -> None:
    """Singles, batches and dry runs at once over three replicas; each answer must be what
    one-at-a-time scoring in the log's order gives. A mirror past its index threshold (here
    an exact scan from one entry on) compares on another thread than the event loop's, with
    the same answers."""
    settings: dict[str, Any] = {"search": "exact", "index_threshold": 1} if large else {}
    searched_on: set[threading.Thread] = set()
    pool = unit_vectors(40, seed=2)
    rng = np.random.default_rng(3)
    requests: list[tuple[list[Vector], list[str], bool]] = []
    for i in range(90):
        size = 3 if i % 5 == 0 else 1
        # Repeats of earlier vectors make some maxima 1.0 and others small: order shows.
        vectors = [pool[int(j)] for j in rng.integers(0, len(pool), size)]
        requests.append((vectors, [f"r{i}.{k}" for k in range(size)], i % 9 != 4))

    async def scenario() -> list[list[Comparison]]:
        async with replicas(redis_server, redis_prefix, count=3, **settings) as memories:
            for memory in memories:
                nearest = memory.mirror.nearest

                def recorded(*args: Any, nearest: Any = nearest, **kwargs: Any) -> Any:
                    searched_on.add(threading.current_thread())
                    return nearest(*args, **kwargs)

                memory.mirror.nearest = recorded  # type: ignore[method-assign]
            return await asyncio.gather(
                *(
                    memories[i % 3].compare(NS, vectors, trace_ids, add=add)
                    for i, (vectors, trace_ids, add) in enumerate(requests)
                )
            )

    answers = asyncio.run(scenario())
    if large:  # the first exchange finds the mirror empty: that one compares on the loop
        assert searched_on - {threading.main_thread()}
    else:
        assert searched_on == {threading.main_thread()}
    log = log_entries(redis_server, redis_prefix)
    position = {trace_id: p for p, (trace_id, _) in enumerate(log)}
    added = [r for r in requests if r[2]]
    assert len(log) == sum(len(r[0]) for r in added)
    for (vectors, trace_ids, add), answer in zip(requests, answers, strict=True):
        if add:
            start = position[trace_ids[0]]
            # A batch's entries are consecutive in the order.
            assert [position[t] for t in trace_ids] == list(range(start, start + len(vectors)))
        else:
            assert not set(trace_ids) & set(position)  # a dry run adds nothing
            start = answer[0].size  # the length of the log it saw
        replay = VectorCache(1000)
        for trace_id, vector in log[:start]:
            replay.add(vector, trace_id=trace_id)
        expected = compare_in_order(replay, vectors, trace_ids, add=True)
        assert [summary(c) for c in expected] == [summary(c) for c in answer]


def test_capacity_and_eviction_are_the_shared_memory_s(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    v = unit_vectors(4, seed=4)

    async def scenario() -> None:
        async with replicas(redis_server, redis_prefix, capacity=3) as (a, b):
            await a.compare(NS, v[:2], ["a0", "a1"], add=True)
            second = await b.compare(NS, v[2:], ["b0", "b1"], add=True)
            assert [c.size for c in second] == [2, 3]  # the fourth evicted the first
            stats = await a.stats(NS)
            assert (stats.size, stats.capacity) == (3, 3)
            assert (stats.adds_total, stats.evictions_total) == (4, 1)
            (oldest,) = await a.compare(NS, [v[0]], ["x"], add=False)
            assert oldest.max_cosine is not None
            assert oldest.max_cosine < 0.5
            (kept,) = await a.compare(NS, [v[1]], ["y"], add=False)
            assert kept.max_cosine == pytest.approx(1.0, abs=1e-6)

    run(scenario)
    assert [t for t, _ in log_entries(redis_server, redis_prefix)] == ["a1", "b0", "b1"]


def test_ttl_expires_entries_for_every_replica_on_redis_s_clock(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    v = unit_vectors(2, seed=5)

    async def scenario() -> None:
        # B's entry must outlive the two calls after it: a TTL far longer than they take even
        # on a slow, busy machine; the sleep passes it whatever the machine's speed.
        async with replicas(redis_server, redis_prefix, ttl_ms=1500) as (a, b):
            await a.compare(NS, [v[0]], ["old"], add=True)
            await asyncio.sleep(1.6)
            (fresh,) = await b.compare(NS, [v[1]], ["new"], add=True)
            assert fresh == Comparison(None, 0, stored=True)  # A's entry expired before B's turn
            stats = await a.stats(NS)
            assert stats.size == 1
            assert stats.ttl_ms == 1500

    run(scenario)
    # Redis dropped it too (XTRIM MINID at Redis's TIME).
    assert [t for t, _ in log_entries(redis_server, redis_prefix)] == ["new"]


def test_a_reset_on_one_replica_empties_the_memory_for_all(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    v = unit_vectors(4, seed=6)

    async def scenario() -> None:
        async with replicas(redis_server, redis_prefix) as (a, b):
            await a.compare(NS, v[:3], ids("a", 3), add=True)
            assert await b.clear(NS) == 3
            assert (await a.stats(NS)).size == 0
            assert await a.compare(NS, [v[0]], ["again"], add=True) == [
                Comparison(None, 0, stored=True)
            ]
            (after,) = await b.compare(NS, [v[0]], ["b"], add=False)
            assert after.size == 1
            assert after.max_cosine == pytest.approx(1.0, abs=1e-6)
            assert (await b.stats(NS)).adds_total == 4  # counters survive a reset, as in process

    run(scenario)


def test_keys_that_vanish_start_a_new_memory(redis_server: RedisServer, redis_prefix: str) -> None:
    """FLUSHALL, or a Redis that restarted without its data: replicas rebuild, not diverge."""
    v = unit_vectors(2, seed=7)

    async def scenario() -> None:
        async with replicas(redis_server, redis_prefix) as (a, b):
            await a.compare(NS, [v[0]], ["a"], add=True)
            with redis_server.client() as client:
                client.delete(f"{redis_prefix}novelty:log", f"{redis_prefix}novelty:meta")
            assert await b.compare(NS, [v[1]], ["b"], add=True) == [
                Comparison(None, 0, stored=True)
            ]
            (seen,) = await a.compare(NS, [v[0]], ["probe"], add=False)
            assert seen.size == 1  # only B's entry: A's mirror was rebuilt
            assert seen.max_cosine is not None
            assert seen.max_cosine < 0.5

    run(scenario)


def test_replicas_with_other_settings_or_model_are_refused_until_a_reset(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    v = unit_vectors(1, seed=8)

    async def scenario() -> None:
        async with (
            replicas(redis_server, redis_prefix, count=1) as (a,),
            replicas(redis_server, redis_prefix, count=1, capacity=5) as (small,),
            replicas(redis_server, redis_prefix, count=1, model="other-model") as (other,),
        ):
            await a.compare(NS, v, ["a"], add=True)
            for wrong, words in ((small, "KP_CACHE_CAPACITY=1000"), (other, "other-model")):
                with pytest.raises(MemoryUnavailableError, match=words):
                    await wrong.compare(NS, v, ["x"], add=True)
                assert not wrong.backend.available
                assert words in (wrong.backend.reason or "")
            assert (await a.stats(NS)).size == 1  # nothing of theirs was added
            # A reset from a replica gives the memory its settings.
            assert await small.clear(NS) == 1
            assert await small.compare(NS, v, ["s"], add=True) == [Comparison(None, 0, stored=True)]
            with pytest.raises(MemoryUnavailableError, match="KP_CACHE_CAPACITY=5"):
                await a.compare(NS, v, ["a2"], add=True)

    run(scenario)


@pytest.mark.redis
def test_a_refused_replica_starts_without_waiting_out_its_timeout(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    """Its start reports the refusal at once (the service then serves, saying why) instead of
    waiting for a first page that no retry within the timeout can bring."""
    hour_ms = 3_600_000

    async def scenario() -> None:
        async with replicas(redis_server, redis_prefix, count=1):
            refused = shared_memory(redis_server, redis_prefix, capacity=5, timeout_ms=hour_ms)
            try:
                # Far below the hour it would wait for if it waited for a first page.
                await asyncio.wait_for(refused.start(), timeout=60)
                assert not refused.backend.available
                assert "KP_CACHE_CAPACITY=1000" in (refused.backend.reason or "")
            finally:
                await refused.close()

    run(scenario)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.redis
def test_redis_down_at_start_then_back(tmp_path: Path) -> None:
    redis = RedisServer(tmp_path)
    redis.stop()
    v = unit_vectors(1, seed=9)

    async def scenario() -> None:
        async with replicas(redis, "kp:", count=1) as (memory,):
            assert not memory.backend.available
            assert "ConnectionError" in (memory.backend.reason or "")
            for _ in range(5):
                with pytest.raises(MemoryUnavailableError, match=r"127\.0\.0\.1"):
                    await memory.compare(NS, v, ["t"], add=True)
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
    logger, records = logging.getLogger("app.store.redis_shared"), _Records()
    logger.addHandler(records)
    try:
        run(scenario)
    finally:
        logger.removeHandler(records)
        redis.stop()
    messages = records.messages
    assert sum(m.startswith("shared cache unavailable") for m in messages) == 1
    assert sum(m.startswith("shared cache available again") for m in messages) == 1


def test_a_comparison_longer_than_the_redis_timeout_is_still_answered(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    """KP_REDIS_TIMEOUT_MS bounds the wait for Redis, not the mirror's own work after Redis
    has answered (a large memory's search, here held past the timeout): the request gets its
    comparison, not cache_unavailable."""
    v = unit_vectors(2, seed=4)

    async def scenario() -> None:
        async with replicas(
            redis_server, redis_prefix, count=1, timeout_ms=1_000, search="exact", index_threshold=1
        ) as (memory,):
            await memory.compare(NS, [v[0]], ["t0"], add=True)
            nearest = memory.mirror.nearest

            def slow(*args: Any, **kwargs: Any) -> Any:
                time.sleep(1.5)  # on the comparison's thread, after Redis answered
                return nearest(*args, **kwargs)

            memory.mirror.nearest = slow  # type: ignore[method-assign]
            (compared,) = await memory.compare(NS, [v[1]], ["t1"], add=True)
            assert compared.size == 1
            assert compared.nearest is not None
            assert compared.nearest.trace_id == "t0"

    run(scenario)
    assert [t for t, _ in log_entries(redis_server, redis_prefix)] == ["t0", "t1"]


@pytest.mark.redis
def test_a_redis_that_does_not_answer_costs_a_request_the_timeout_only(tmp_path: Path) -> None:
    """SIGSTOP: connections stay open and nothing answers, the worst case for a client."""
    redis = RedisServer(tmp_path)
    v = unit_vectors(1, seed=10)

    async def scenario() -> None:
        async with replicas(redis, "kp:", count=1, timeout_ms=300) as (memory,):
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


@pytest.mark.redis
def test_acknowledged_adds_survive_kill_9_of_redis(tmp_path: Path) -> None:
    redis = RedisServer(tmp_path)
    v = unit_vectors(20, seed=11)

    async def scenario(before_kill: bool) -> None:
        async with replicas(redis, "kp:", count=1) as (memory,):
            if before_kill:
                for i, vector in enumerate(v):
                    await memory.compare(NS, [vector], [f"t{i}"], add=True)
            else:
                stats = await memory.stats(NS)
                assert stats.size == len(v)
                (seen,) = await memory.compare(NS, [v[7]], ["probe"], add=False)
                assert seen.max_cosine == pytest.approx(1.0, abs=1e-6)

    try:
        run(lambda: scenario(True))
        redis.stop(signal.SIGKILL)
        redis.start()  # replays its append-only file
        run(lambda: scenario(False))
        assert [t for t, _ in log_entries(redis, "kp:")] == [f"t{i}" for i in range(20)]
    finally:
        redis.stop()


# ── settings and the app around the store ──────────────────────────────────────────────


@pytest.mark.parametrize(
    "url",
    [
        "http://:hunter2@cache:6379/0",
        "cache:6379",
        "redis://:hunter2@",
        "redis://:hunter2@cache:notaport/0",
        "redis://:hunter2@cache:6379/zero",
        "unix:///run/redis.sock",
    ],
)
def test_a_bad_redis_url_stops_the_start_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    monkeypatch.setenv("KP_REDIS_URL", url)
    with pytest.raises(ConfigError, match="KP_REDIS_URL") as caught:
        Settings.from_env()
    assert "hunter2" not in str(caught.value)


def test_redis_and_a_snapshot_path_are_refused_together(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KP_REDIS_URL", "rediss://kp:hunter2@cache.internal:6380/2")
    monkeypatch.setenv("KP_CACHE_SNAPSHOT_PATH", str(tmp_path / "cache.snapshot"))
    with pytest.raises(ConfigError, match="KP_CACHE_SNAPSHOT_PATH and KP_REDIS_URL"):
        Settings.from_env()
    monkeypatch.delenv("KP_CACHE_SNAPSHOT_PATH")
    settings = Settings.from_env()
    assert "hunter2" not in repr(settings)
    assert settings.redis_url is not None
    url = settings.redis_url.get_secret_value()
    assert redis_location(url) == "rediss://kp@cache.internal:6380/2"


def test_the_default_is_the_in_process_cache(make_client: ClientFactory) -> None:
    client = make_client(embedder="none")
    assert client.get("/cache").json()["backend"] == {
        "kind": "in_process",
        "shared": False,
        "location": None,
        "prefix": None,
        "available": True,
        "reason": None,
        "outages_total": 0,
    }


def test_redis_unreachable_at_start_scores_on_with_cache_unavailable(
    make_client: ClientFactory,
) -> None:
    """The real model embeds; only the memory is missing: N = 0.5, said so, nothing added."""
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    client = make_client(redis_url=url, embedder_preload=True)
    r = client.post("/evaluate", json=make_trace())
    assert r.status_code == 200
    body = r.json()
    assert body["dimensions"]["novelty"] == 0.5
    novelty = body["novelty"]
    assert (novelty["measured"], novelty["reason"]) == (False, "cache_unavailable")
    assert novelty["tokens"] > 0  # the model did read it
    assert "127.0.0.1" in novelty["detail"]
    assert "hunter2" not in novelty["detail"]
    ready = client.get("/readyz").json()
    assert (ready["status"], ready["degraded"]) == ("degraded", True)
    assert ready["embedder"]["state"] == "ready"
    assert ready["cache_backend"]["available"] is False
    assert any("shared cache" in w for w in ready["warnings"])
    metrics = client.get("/metrics").text
    assert "kp_cache_available 0.0" in metrics
    assert 'kp_novelty_unmeasured_total{reason="cache_unavailable"} 1.0' in metrics
    cleared = client.delete("/cache")
    assert cleared.status_code == 503
    assert cleared.headers["retry-after"] == "1"
    stats = client.get("/cache").json()
    assert (stats["size"], stats["backend"]["available"]) == (0, False)
    for path in ("/cache", "/readyz", "/metrics"):
        assert "hunter2" not in client.get(path).text


async def _late_replica(
    redis_server: RedisServer, prefix: str, count: int, seed: int, **settings: Any
) -> tuple[RedisSharedMemory, npt.NDArray[np.float32]]:
    """A shared memory of `count` random unit vectors (imported by a first replica, ids
    e0, e1, ...), and a new replica started against it with `settings`."""
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((count, 384)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    now = time.time() * 1000
    async with replicas(redis_server, prefix, count=1, capacity=50_000) as (writer,):
        entries = CacheEntries(v, np.full(count, now), [f"e{i}" for i in range(count)])
        assert await writer.import_entries(NS, entries) == (count, 0)
    late = shared_memory(redis_server, prefix, capacity=50_000, **settings)
    await late.start()
    return late, v


async def _caught_up(late: RedisSharedMemory) -> None:
    """Waits for the first catch-up to end (the bound only stops a broken test hanging)."""
    for _ in range(1200):
        if late.warming is None:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"still warming after a minute: {late.warming}")


def test_a_replica_catches_up_with_a_large_log_a_page_at_a_time(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    """A new replica meets a log far longer than a page: its start returns after the first
    page, it says warming (with progress) and refuses to score until it has every entry,
    then answers from all of them, naming the planted one."""
    count = 6 * PAGE + 123

    async def scenario() -> None:
        late, v = await _late_replica(
            redis_server, redis_prefix, count, seed=12, index_threshold=5_000
        )
        try:
            loading = late.warming
            assert loading is not None
            assert loading == (PAGE, count)
            status = late.index_status()
            assert status.warming
            assert status.progress == pytest.approx(PAGE / count)
            with pytest.raises(MemoryUnavailableError, match="cache_warming"):
                await late.compare(NS, [v[0]], ["x"], add=True)
            await _caught_up(late)
            assert late.size == count
            (answer,) = await late.compare(NS, [v[count - 7]], ["probe"], add=False)
            assert answer.nearest is not None
            assert answer.nearest.trace_id == f"e{count - 7}"
            assert answer.max_cosine == pytest.approx(1.0, abs=1e-6)
        finally:
            await late.close()

    run(scenario)


def test_a_replica_catching_up_on_a_slow_host_gets_every_entry_before_it_is_ready(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    """A page of the log is megabytes: on a slow or busy CPU it takes longer than
    KP_REDIS_TIMEOUT_MS, a request's budget (here 1 ms, which no page meets). The first
    catch-up is bounded by its own, longer limit, so the replica loads every entry and only
    then stops warming; it never reports itself caught up with part of the log."""
    count = 3 * PAGE + 45

    async def scenario() -> None:
        late, _ = await _late_replica(
            redis_server, redis_prefix, count, seed=13, timeout_ms=1, index_threshold=50_000
        )
        try:
            await _caught_up(late)
            assert late.size == count
            assert late.backend.available
        finally:
            await late.close()

    run(scenario)


def test_reading_back_an_import_is_bulk_work_not_a_request(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    """After an import the mirror reads the new entries back a page at a time (megabytes
    each): those pages get the bulk timeout, not a request's (KP_REDIS_TIMEOUT_MS, here
    200 ms), so a Redis busy for longer meanwhile (here a 0.5 s script) does not mark the
    memory unavailable, and the next import is taken, where it was once answered 503."""
    count = 3 * PAGE + 17
    rng = np.random.default_rng(81)
    busy = (
        "local t = redis.call('TIME') local start = t[1] * 1e6 + t[2] "
        "repeat t = redis.call('TIME') until t[1] * 1e6 + t[2] - start > 500000 return 1"
    )

    def batch(k: int) -> CacheEntries:
        v = rng.standard_normal((count, 384)).astype(np.float32)
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        now = np.full(count, time.time() * 1000)
        return CacheEntries(v, now, [f"i{k}-{i}" for i in range(count)])

    async def scenario() -> None:
        memory = shared_memory(redis_server, redis_prefix, capacity=50_000, timeout_ms=200)
        other = AsyncRedis.from_url(redis_server.url)
        await memory.start()
        try:
            await _caught_up(memory)
            for k in range(2):
                assert await memory.import_entries(NS, batch(k)) == (count, 0)
                # Redis busy while the pages are read back (another client's long script).
                await other.eval(busy, 0)
                for _ in range(1200):
                    if memory.mirror.size == (k + 1) * count:
                        break
                    await asyncio.sleep(0.05)
                assert memory.mirror.size == (k + 1) * count
                # Never marked unavailable meanwhile (the probe would bring it back, but an
                # import arriving in between was answered 503).
                assert memory.backend.available, memory.backend
                assert memory.backend.outages_total == 0, memory.backend
        finally:
            await other.aclose()
            await memory.close()

    run(scenario)
