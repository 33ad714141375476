"""Acknowledged means kept, in process: the journal beside the snapshot. A server killed (-9)
right after its answers, round after round, comes back with every trace it acknowledged; so
does a 30,000-line import; a torn record is dropped and the journal goes on; a snapshot save
compacts it. Real processes and the real model."""

from __future__ import annotations

import json
import signal
import struct
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from app.domain.vector_cache import CacheEntries, VectorCache
from app.services.snapshots import SnapshotError, read_snapshot
from app.store.journal import Journal
from tests.factories import import_body, make_trace
from tests.server import LiveServer

pytestmark = pytest.mark.server


def ids_in(server: LiveServer) -> list[str]:
    r = server.client.get("/cache/export")
    assert r.status_code == 200, r.text
    return [orjson.loads(line)["trace_id"] for line in r.content.splitlines() if line.strip()]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {
        "KP_CACHE_SNAPSHOT_PATH": str(tmp_path / "cache.snapshot"),
        # No periodic save during the test: only the journal can keep what was answered.
        "KP_CACHE_SNAPSHOT_INTERVAL_S": "3600",
        "KP_CACHE_CAPACITY": "40000",
        "KP_EMBEDDER_PRELOAD": "true",
        "KP_EMBEDDER_THREADS": "1",
        "KP_EMBEDDER_WORKERS": "1",
        "KP_LOG_LEVEL": "warning",
    }


@pytest.fixture
def servers(env: dict[str, str], tmp_path: Path) -> Iterator[list[LiveServer]]:
    started: list[LiveServer] = []
    yield started
    for server in started:
        if server.process.poll() is None:
            server.stop(signal.SIGKILL)


@pytest.mark.parametrize("fsync", ["everysec", pytest.param("always", marks=pytest.mark.slow)])
def test_kill_9_right_after_the_answers_loses_nothing_acknowledged(
    env: dict[str, str], tmp_path: Path, servers: list[LiveServer], fsync: str
) -> None:
    env = env | {"KP_CACHE_JOURNAL_FSYNC": fsync}
    acknowledged: list[str] = []
    for round_ in range(3):
        server = LiveServer(env, tmp_path / "server.log")
        servers.append(server)
        assert sorted(ids_in(server)) == sorted(acknowledged)  # every one answered

        def post(i: int, server: LiveServer = server, round_: int = round_) -> str | None:
            trace_id = f"kp:trace:r{round_}-{i}"
            trace = make_trace(trace_id=trace_id, objective=f"journal {round_} {i} {uuid.uuid4()}")
            r = server.post("/evaluate", trace)
            return trace_id if r.status_code == 200 else None

        with ThreadPoolExecutor(4) as pool:
            answered = [t for t in pool.map(post, range(12)) if t is not None]
        server.stop(signal.SIGKILL)  # at once after the last answer
        assert len(answered) == 12
        acknowledged += answered

    last = LiveServer(env, tmp_path / "server.log")
    servers.append(last)
    assert sorted(ids_in(last)) == sorted(acknowledged)
    assert len(ids_in(last)) == 36


@pytest.mark.slow
def test_an_acknowledged_30000_line_import_survives_kill_9(
    env: dict[str, str], tmp_path: Path, servers: list[LiveServer]
) -> None:
    server = LiveServer(env, tmp_path / "server.log")
    servers.append(server)
    assert server.post("/evaluate", make_trace(trace_id="kp:trace:before")).status_code == 200
    r = server.client.post(
        "/cache/import",
        content=import_body(30_000, seed=30_000, id_prefix="kp:trace:imported-"),
        headers={"content-type": "application/x-ndjson"},
    )
    assert r.status_code == 200, r.text
    assert r.json()["imported"] == 30_000
    server.stop(signal.SIGKILL)

    again = LiveServer(env, tmp_path / "server.log")
    servers.append(again)
    ids = ids_in(again)
    assert len(ids) == 30_001
    assert ids[0] == "kp:trace:before"
    assert ids[-1] == "kp:trace:imported-29999"
    # A clear is kept too.
    assert again.client.delete("/cache").status_code == 200
    again.stop(signal.SIGKILL)
    last = LiveServer(env, tmp_path / "server.log")
    servers.append(last)
    assert ids_in(last) == []


def test_a_save_compacts_the_journal_and_a_restart_replays_what_came_after(
    env: dict[str, str], tmp_path: Path, servers: list[LiveServer]
) -> None:
    env = env | {"KP_CACHE_SNAPSHOT_INTERVAL_S": "0.2"}
    server = LiveServer(env, tmp_path / "server.log")
    servers.append(server)
    for i in range(3):
        trace = make_trace(trace_id=f"kp:trace:c{i}", objective=f"compaction {i}")
        assert server.post("/evaluate", trace).status_code == 200
    deadline = time.monotonic() + 30
    while len(saved(tmp_path / "cache.snapshot")) < 3:
        assert time.monotonic() < deadline, "no save after the adds"
        time.sleep(0.05)
    time.sleep(0.3)  # the save's last step: the older generations are deleted
    journals = sorted(tmp_path.glob("cache.snapshot.journal.*"))
    assert len(journals) == 1  # the older generations were dropped
    trace = make_trace(trace_id="kp:trace:after", objective="after the save")
    assert server.post("/evaluate", trace).status_code == 200
    server.stop(signal.SIGKILL)
    again = LiveServer(env | {"KP_CACHE_SNAPSHOT_INTERVAL_S": "3600"}, tmp_path / "server.log")
    servers.append(again)
    assert ids_in(again) == ["kp:trace:c0", "kp:trace:c1", "kp:trace:c2", "kp:trace:after"]


def saved(path: Path) -> list[str]:
    try:
        return list(read_snapshot(path, "", 384).ids())
    except (OSError, SnapshotError) as exc:
        if isinstance(exc, SnapshotError) and exc.kind == "other_model":
            return list(read_snapshot(path, model_of(path), 384).ids())
        return []


def model_of(path: Path) -> str:
    data = path.read_bytes()
    (length,) = struct.unpack_from("<I", data, 8)
    model: str = json.loads(data[12 : 12 + length])["model"]
    return model


def entries(ids: list[str], seed: int) -> CacheEntries:
    rng = np.random.default_rng(seed)
    return CacheEntries(
        rng.standard_normal((len(ids), 8)).astype(np.float32),
        np.arange(len(ids), dtype=np.float64) + 1e12,
        ids,
    )


def replayed(journal: Journal) -> list[Any]:
    return [None if c.entries is None else list(c.entries.ids()) for c in journal.replay(0)]


def test_a_torn_record_is_dropped_and_the_journal_goes_on(tmp_path: Path) -> None:
    base = tmp_path / "cache.snapshot"
    journal = Journal(base, "model", 8, "always")
    list(journal.replay(0))
    journal.open()
    journal.record_adds(entries(["a", "b"], 1))
    journal.record_clear()
    journal.record_adds(entries(["c"], 2))
    journal.close()
    path = journal.path(0)
    whole = path.read_bytes()
    path.write_bytes(whole[:-5])  # the last record cut short, as a power loss would

    again = Journal(base, "model", 8, "always")
    assert replayed(again) == [["a", "b"], None]
    again.open()
    again.record_adds(entries(["d"], 3))
    again.close()
    assert replayed(Journal(base, "model", 8, "always")) == [["a", "b"], None, ["d"]]

    other = Journal(base, "another-model", 8, "always")
    assert replayed(other) == []  # another model's journal is set aside, not loaded
    assert list(tmp_path.glob("cache.snapshot.journal.000000.other_model-*"))


def test_replayed_changes_rebuild_the_same_memory(tmp_path: Path) -> None:
    base = tmp_path / "cache.snapshot"
    journal = Journal(base, "model", 8, "everysec")
    journal.open()
    cache = VectorCache(capacity=5, dimensions=8)
    rng = np.random.default_rng(0)
    for i in range(9):
        with journal.lock:
            before = cache.sequence_range[1]
            cache.add(rng.standard_normal(8), trace_id=f"t{i}")
            first, after = cache.sequence_range
            journal.record_adds(cache.entries_between(max(first, before), after))
    journal.close()
    rebuilt = VectorCache(capacity=5, dimensions=8)
    for change in Journal(base, "model", 8, "everysec").replay(0):
        assert change.entries is not None
        rebuilt.extend(change.entries.vectors, change.entries.added_at_ms, change.entries.ids())
    assert (
        list(rebuilt.entries().ids())
        == list(cache.entries().ids())
        == [f"t{i}" for i in range(4, 9)]
    )
    np.testing.assert_array_equal(rebuilt.entries().vectors, cache.entries().vectors)
    np.testing.assert_array_equal(rebuilt.entries().added_at_ms, cache.entries().added_at_ms)
