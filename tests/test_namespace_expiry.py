"""Namespaces whose every entry expired no longer count against KP_MAX_NAMESPACES, and their
memory is given back, in both stores: 1,000 namespaces made and left to expire, 50 at a time,
through a live server (docs/operating/persistence.md, docs/operating/scaling.md)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
import pytest

from tests.factories import export_line, random_units
from tests.server import TOKEN, LiveServer, RedisServer

pytestmark = [pytest.mark.server, pytest.mark.slow]

LIMIT = 50
NAMESPACES = 1_000
TTL_MS = 1_500
#: Longest any wait for an expiry or a sweep: generous, never a measurement.
PATIENCE_S = 60.0


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _import(client: httpx.Client, namespace: str, vector_seed: int) -> httpx.Response:
    """One entry, added now, into `namespace` (an import: an add that needs no model)."""
    line = export_line(f"kp:trace:{namespace}", random_units(1, vector_seed)[0], time.time() * 1e3)
    return client.post(
        "/cache/import",
        content=orjson.dumps(line) + b"\n",
        headers={
            "KP-Namespace": namespace,
            "Authorization": f"Bearer {TOKEN}",
            "Content-Type": "application/x-ndjson",
        },
    )


def _until(condition: Callable[[], bool], patience_s: float = PATIENCE_S) -> None:
    deadline = time.monotonic() + patience_s
    while not condition():
        assert time.monotonic() < deadline, "not within the patience"
        time.sleep(0.1)


def _namespaces(client: httpx.Client) -> list[str]:
    r = client.get("/cache/namespaces", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200, r.text
    names: list[str] = r.json()["namespaces"]
    return names


def _waves(server: LiveServer, after_wave: Callable[[], None] | None = None) -> None:
    """1,000 namespaces, LIMIT at a time: each wave fills the limit (one more is refused with
    409), then expires; the next wave is never refused."""
    client = server.client
    for wave in range(NAMESPACES // LIMIT):
        names = [f"w{wave}-n{i}" for i in range(LIMIT)]
        started = time.time()
        for i, name in enumerate(names):
            r = _import(client, name, wave * LIMIT + i)
            assert r.status_code == 200, (name, r.status_code, r.text)
        one_more = _import(client, f"one-more-{wave}", 0).status_code
        # Refused while the whole wave holds entries: answered before its first entry
        # could expire (on a busy host a wave may outlast the TTL: then it may be admitted).
        if time.time() < started + TTL_MS / 1000:
            assert one_more == 409
        time.sleep(TTL_MS / 1000 * 1.2)  # every entry of the wave expired
        if after_wave is not None:
            after_wave()
    _until(lambda: _namespaces(client) == [])


def test_in_process_1000_namespaces_expire_and_give_their_memory_back(tmp_path: Path) -> None:
    """With the database: the rings are let go and the rows deleted; RSS back within 10 MB of
    where it was before the first namespace."""
    path = tmp_path / "memory.db"
    server = LiveServer(
        {
            "KP_CACHE_DB_PATH": str(path),
            "KP_EMBEDDER_PRELOAD": "true",
            "KP_MAX_NAMESPACES": str(LIMIT),
            "KP_CACHE_TTL_MS": str(TTL_MS),
            "KP_ADMIN_TOKEN": TOKEN,
            "KP_LOG_LEVEL": "warning",
        },
        tmp_path / "server.log",
    )
    try:
        assert _import(server.client, "warm-up", 1).status_code == 200
        time.sleep(TTL_MS / 1000 * 1.2)
        start = _rss_mb(server.process.pid)
        _waves(server)
        # One more import after the last wave expired: the memory lets go of that wave.
        time.sleep(2.5)
        assert _import(server.client, "last", 2).status_code == 200
        end = _rss_mb(server.process.pid)
        assert end - start < 10, (start, end)
    finally:
        server.stop()
    import sqlite3

    conn = sqlite3.connect(path)
    try:
        left = dict(conn.execute("SELECT namespace, count(*) FROM entries GROUP BY namespace"))
    finally:
        conn.close()
    assert set(left) <= {"last"}, sorted(left)[:5]


def test_shared_1000_namespaces_expire_and_give_their_memory_back(tmp_path: Path) -> None:
    """In Redis: the registry gives their places back; their keys and indexes are deleted
    (Redis's used_memory back within 10 MB of where it was) and the replica's RSS too."""
    (tmp_path / "redis").mkdir()
    redis = RedisServer(tmp_path / "redis")
    replica = LiveServer(
        {
            "KP_EMBEDDER": "none",
            "KP_REDIS_URL": redis.url,
            "KP_MAX_NAMESPACES": str(LIMIT),
            "KP_CACHE_TTL_MS": str(TTL_MS),
            "KP_ADMIN_TOKEN": TOKEN,
            "KP_LOG_LEVEL": "warning",
        },
        tmp_path / "replica.log",
    )

    def used_mb() -> float:
        with redis.client() as client:
            return int(client.info("memory")["used_memory"]) / 2**20

    try:
        assert _import(replica.client, "warm-up", 1).status_code == 200
        time.sleep(TTL_MS / 1000 * 1.2)
        redis_start, replica_start = used_mb(), _rss_mb(replica.process.pid)
        _waves(replica)
        with redis.client() as client:
            _until(lambda: client.scard("kp:namespaces") == 0)
            indexes = client.execute_command("FT._LIST")
            assert len(indexes) <= 2, indexes  # the default namespace's, perhaps
        # RediSearch frees a dropped index's memory in the background, a little at a time
        # (tens of seconds for these 50).
        _until(lambda: used_mb() - redis_start < 10, patience_s=300)
        assert _rss_mb(replica.process.pid) - replica_start < 10
    finally:
        replica.stop()
        redis.stop()
