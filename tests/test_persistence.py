"""Cache snapshots: restart, crash, damage, other models, unwritable disks."""

from __future__ import annotations

import errno
import hashlib
import json
import re
import signal
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from app.domain.vector_cache import CacheEntries
from app.services import snapshots
from app.services.snapshots import SnapshotError, read_snapshot, write_snapshot
from tests.conftest import ClientFactory
from tests.factories import make_trace
from tests.server import LiveServer

MODEL = "test-model"


def entries(n: int, dims: int = 384) -> CacheEntries:
    rng = np.random.default_rng(n)
    return CacheEntries(
        rng.standard_normal((n, dims)).astype(np.float32),
        np.arange(n, dtype=np.float64) + 1e12,
        [f"kp:trace:{i}" for i in range(n)],
    )


def test_snapshot_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "cache.snapshot"
    original = entries(5)
    write_snapshot(path, original, MODEL)
    loaded = read_snapshot(path, MODEL, 384)
    np.testing.assert_array_equal(loaded.vectors, original.vectors)
    np.testing.assert_array_equal(loaded.added_at_ms, original.added_at_ms)
    assert list(loaded.trace_ids) == list(original.trace_ids)
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


def test_a_format_1_snapshot_still_loads_without_trace_ids(tmp_path: Path) -> None:
    """Written as the previous version did: no trace ids after the times."""
    original = entries(4)
    payload = original.vectors.astype("<f4").tobytes() + original.added_at_ms.tobytes()
    header = json.dumps(
        {
            "version": 1,
            "model": MODEL,
            "dimensions": 384,
            "count": 4,
            "saved_at_ms": 0.0,
            "payload_sha256": hashlib.sha256(payload).hexdigest(),
        }
    ).encode()
    path = tmp_path / "old.snapshot"
    path.write_bytes(b"KPCACHE1" + struct.pack("<I", len(header)) + header + payload)
    loaded = read_snapshot(path, MODEL, 384)
    np.testing.assert_array_equal(loaded.vectors, original.vectors)
    assert list(loaded.ids()) == [""] * 4


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[: len(b) // 2],  # truncated
        lambda b: b[:10],  # truncated header
        lambda b: b[:-1] + bytes([b[-1] ^ 0xFF]),  # flipped payload byte
        lambda b: b"GARBAGE!" + b[8:],  # bad magic
        lambda b: b"",  # empty
    ],
    ids=["half", "header", "flipped", "magic", "empty"],
)
def test_damaged_snapshots_are_detected(tmp_path: Path, damage: object) -> None:
    path = tmp_path / "cache.snapshot"
    write_snapshot(path, entries(3), MODEL)
    path.write_bytes(damage(path.read_bytes()))  # type: ignore[operator]
    with pytest.raises(SnapshotError) as caught:
        read_snapshot(path, MODEL, 384)
    assert caught.value.kind == "corrupt"


def test_other_model_or_dimension_is_not_loaded(tmp_path: Path) -> None:
    path = tmp_path / "cache.snapshot"
    write_snapshot(path, entries(3), "another-model")
    with pytest.raises(SnapshotError, match="another-model") as caught:
        read_snapshot(path, MODEL, 384)
    assert caught.value.kind == "other_model"
    write_snapshot(path, entries(3, dims=8), MODEL)
    with pytest.raises(SnapshotError, match="8 dimensions"):
        read_snapshot(path, MODEL, 384)


def test_cache_survives_a_restart_in_process(make_client: ClientFactory, tmp_path: Path) -> None:
    path = tmp_path / "cache.snapshot"
    first = make_client(cache_snapshot_path=path)
    for objective in ("alpha topic", "beta topic", "gamma topic"):
        first.post("/evaluate", json=make_trace(objective=objective))
    first.__exit__(None, None, None)  # shutdown saves
    assert path.exists()

    second = make_client(cache_snapshot_path=path)
    ready = second.get("/readyz").json()
    assert ready["snapshot"]["state"] == "loaded"
    assert ready["snapshot"]["loaded_vectors"] == 3
    assert second.get("/cache").json()["size"] == 3
    repeat = second.post("/evaluate", json=make_trace(objective="beta topic")).json()
    assert repeat["novelty"]["measured"] is True
    assert repeat["dimensions"]["novelty"] == pytest.approx(0.0, abs=1e-6)


def test_corrupt_snapshot_is_set_aside_and_reported(
    make_client: ClientFactory, tmp_path: Path
) -> None:
    path = tmp_path / "cache.snapshot"
    path.write_bytes(b"KPCACHE1\x05\x00\x00\x00{oops")
    client = make_client(cache_snapshot_path=path)
    ready = client.get("/readyz").json()
    assert ready["snapshot"]["state"] == "set_aside"
    assert any("snapshot" in w for w in ready["warnings"])
    assert client.get("/cache").json()["size"] == 0
    assert not path.exists()
    assert len(list(tmp_path.glob("cache.snapshot.corrupt-*"))) == 1
    assert client.post("/evaluate", json=make_trace()).status_code == 200


def test_snapshot_of_another_model_is_set_aside(make_client: ClientFactory, tmp_path: Path) -> None:
    path = tmp_path / "cache.snapshot"
    write_snapshot(path, entries(4), "some-other-model")
    client = make_client(cache_snapshot_path=path)
    assert client.get("/readyz").json()["snapshot"]["state"] == "set_aside"
    assert len(list(tmp_path.glob("cache.snapshot.other_model-*"))) == 1
    assert client.get("/cache").json()["size"] == 0


def test_unwritable_snapshot_location_keeps_serving(
    make_client: ClientFactory, tmp_path: Path
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where a directory should be")
    client = make_client(
        cache_snapshot_path=blocker / "cache.snapshot", cache_snapshot_interval_s=0.05
    )
    assert client.post("/evaluate", json=make_trace()).status_code == 200
    deadline = time.monotonic() + 10
    while client.get("/readyz").json()["snapshot"]["save_errors_total"] == 0:
        assert time.monotonic() < deadline, "the periodic save never ran"
        time.sleep(0.05)
    ready = client.get("/readyz").json()
    assert "Not a directory" in ready["snapshot"]["last_save_error"]
    assert any("not saved" in w for w in ready["warnings"])
    errors = ready["snapshot"]["save_errors_total"]
    metrics = client.get("/metrics").text
    assert re.search(r"^# TYPE kp_snapshot_save_errors(_total)? counter$", metrics, re.M)
    saved = re.search(r"^kp_snapshot_save_errors_total (\S+)$", metrics, re.M)
    assert saved is not None
    assert float(saved.group(1)) >= errors >= 1
    assert client.post("/evaluate", json=make_trace()).status_code == 200


def test_disk_full_keeps_the_old_snapshot(
    make_client: ClientFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "cache.snapshot"
    write_snapshot(path, entries(2), "placeholder")
    before = path.read_bytes()

    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    client = make_client(cache_snapshot_path=tmp_path / "other.snapshot")
    client.post("/evaluate", json=make_trace())
    store = client.app.state.services.snapshots  # type: ignore[attr-defined]
    store.status.path = path
    monkeypatch.setattr(snapshots.os, "fsync", no_space)
    assert store.save(force=True) is False
    assert "No space left" in store.status.last_save_error
    assert path.read_bytes() == before  # the previous snapshot is untouched
    assert list(tmp_path.glob(".*.tmp")) == []


@pytest.mark.server
def test_sigterm_restart_keeps_the_cache(tmp_path: Path) -> None:
    env = {
        "KP_CACHE_SNAPSHOT_PATH": str(tmp_path / "cache.snapshot"),
        "KP_EMBEDDER_PRELOAD": "true",
    }
    server = LiveServer(env, tmp_path / "server.log")
    traces = [make_trace(objective=f"restart topic number {i}") for i in range(5)]
    for trace in traces:
        assert server.post("/evaluate", trace).status_code == 200
    # The server shuts down gracefully (lifespan, snapshot) on SIGTERM.
    assert server.stop(signal.SIGTERM) in (0, -signal.SIGTERM)
    assert '"kp-scoring stopped"' in server.log()

    again = LiveServer(env, tmp_path / "server.log")
    try:
        assert again.client.get("/cache").json()["size"] == 5
        repeat = again.post("/evaluate", traces[2]).json()
        assert repeat["dimensions"]["novelty"] == pytest.approx(0.0, abs=1e-6)
    finally:
        again.stop()


@pytest.mark.server
@pytest.mark.slow
def test_kill_9_under_load_leaves_a_loadable_snapshot(tmp_path: Path) -> None:
    env = {
        "KP_CACHE_SNAPSHOT_PATH": str(tmp_path / "cache.snapshot"),
        "KP_CACHE_SNAPSHOT_INTERVAL_S": "0.02",
        "KP_EMBEDDER_PRELOAD": "true",
    }
    server = LiveServer(env, tmp_path / "server.log")
    stop = threading.Event()
    failures: list[int] = []

    def load(worker: int) -> None:
        i = 0
        while not stop.is_set():
            try:
                r = server.post("/evaluate", make_trace(objective=f"load {worker} {i}"))
                if r.status_code != 200:
                    failures.append(r.status_code)
            except Exception:
                return  # the server is gone
            i += 1

    threads = [threading.Thread(target=load, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while server.client.get("/readyz").json()["snapshot"]["saves_total"] < 3:
        assert time.monotonic() < deadline, "no periodic saves happened"
        time.sleep(0.02)
    server.stop(signal.SIGKILL)
    stop.set()
    for t in threads:
        t.join()
    assert failures == []

    again = LiveServer(env, tmp_path / "server.log")
    try:
        snapshot = again.client.get("/readyz").json()["snapshot"]
        assert snapshot["state"] == "loaded"
        assert snapshot["loaded_vectors"] > 0
        assert list(tmp_path.glob(".*.tmp")) == []
    finally:
        again.stop()


def test_a_large_cache_is_saved_in_chunks_and_restored_with_its_trace_ids(
    tmp_path: Path,
) -> None:
    """Written from the cache's chunks (never one joined copy); an empty cache saves too."""
    from app.domain.vector_cache import VectorCache
    from app.services.snapshots import SnapshotStore

    cache = VectorCache(capacity=20_000)
    original = entries(10_000)
    cache.load(original)
    assert len(list(cache.chunks())) > 1
    store = SnapshotStore(tmp_path / "big.snapshot", cache, MODEL)
    assert store.save(force=True)
    restored = VectorCache(capacity=20_000)
    SnapshotStore(tmp_path / "big.snapshot", restored, MODEL).restore()
    again = restored.entries()
    np.testing.assert_array_equal(again.vectors, original.vectors)
    assert list(again.trace_ids) == list(original.trace_ids)
    cache.clear()
    assert store.save()
    empty = VectorCache(capacity=20_000)
    loader = SnapshotStore(tmp_path / "big.snapshot", empty, MODEL)
    loader.restore()
    assert loader.status.state.value == "loaded"
    assert empty.size == 0
