"""A rolling change of KP_CACHE_* settings with real replicas on a real Redis: replicas with
new settings are refused by the namespace that has the old ones; a reset from one of them
gives it the new settings, and every replica with those settings recovers by itself within
seconds, without a request of its own."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.factories import import_body
from tests.server import TOKEN, LiveServer, RedisServer

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def backend(server: LiveServer) -> dict[str, object]:
    ready: dict[str, dict[str, object]] = server.client.get("/readyz").json()
    return ready["cache_backend"]


def wait_available(server: LiveServer, within_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < within_s:
        if backend(server)["available"]:
            return time.monotonic() - started
        time.sleep(0.1)
    raise AssertionError(f"still refused after {within_s} s: {backend(server)}")


@pytest.fixture
def env(redis_server: RedisServer, redis_prefix: str) -> dict[str, str]:
    return {
        "KP_EMBEDDER": "none",
        "KP_LOG_LEVEL": "warning",
        "KP_ADMIN_TOKEN": TOKEN,
        "KP_REDIS_URL": redis_server.url,
        "KP_REDIS_PREFIX": redis_prefix,
        "KP_REDIS_TIMEOUT_MS": "5000",
    }


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[LiveServer]]:
    started: list[LiveServer] = []
    yield started
    for s in started:
        s.stop()


def test_replicas_recover_once_a_reset_elsewhere_gives_the_memory_their_settings(
    env: dict[str, str], servers: list[LiveServer], tmp_path: Path
) -> None:
    old = LiveServer(env | {"KP_CACHE_CAPACITY": "1000"}, tmp_path / "old.log")
    servers.append(old)
    r = old.client.post(
        "/cache/import",
        content=import_body(1, seed=1, id_prefix="kp:trace:old-"),
        headers=AUTH | {"content-type": "application/x-ndjson"},
    )
    assert r.status_code == 200, r.text
    assert backend(old)["available"] is True  # the namespace now has 1000, no TTL
    new = {"KP_CACHE_CAPACITY": "5", "KP_CACHE_TTL_MS": "3000"}
    a = LiveServer(env | new, tmp_path / "a.log")
    b = LiveServer(env | new, tmp_path / "b.log")
    servers += [a, b]
    for replica in (a, b):
        refused = backend(replica)
        assert refused["available"] is False
        assert "KP_CACHE_CAPACITY=1000" in str(refused["reason"])
        assert replica.client.get("/readyz").json()["status"] == "degraded"

    r = a.client.delete("/cache", headers=AUTH)
    assert r.status_code == 200, r.text
    assert backend(a)["available"] is True
    # b was not asked anything: its own probe notices the memory's new settings.
    wait_available(b, within_s=10)
    stats = b.client.get("/cache", headers=AUTH).json()
    assert (stats["capacity"], stats["ttl_ms"]) == (5, 3000)
    assert stats["backend"]["available"] is True
    # The replica with the old settings is the one refused now, naming the new ones.
    wait_refused = time.monotonic() + 10
    while backend(old)["available"] and time.monotonic() < wait_refused:
        old.client.get("/cache", headers=AUTH)
        time.sleep(0.1)
    assert "KP_CACHE_CAPACITY=5" in str(backend(old)["reason"])
    with httpx.Client(base_url=b.url) as client:
        assert client.get("/healthz").status_code == 200
