"""The in-process memory's database (KP_CACHE_DB_PATH): real SQLite files, real faults (a full
tmpfs, bytes changed in the file, kill -9), the former files converted."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson
import pytest

from app.core.config import Settings
from app.memory import in_process, sqlite
from app.memory.base import DEFAULT_NAMESPACE
from app.memory.in_process import InProcessMemory
from app.memory.ring import CacheEntries
from app.memory.sqlite import SqliteStore
from tests.conftest import ClientFactory
from tests.factories import make_trace, random_units
from tests.server import LiveServer, refused_start

MODEL = "test-model"
FORMER = Path(__file__).parent / "fixtures" / "former-persistence"


def memory_at(
    path: Path, *, capacity: int = 100, durability: Any = "process", **options: Any
) -> InProcessMemory:
    """A started memory kept at `path`."""
    store = SqliteStore(path, MODEL, 384, durability)
    memory = InProcessMemory(capacity, store=store, **options)
    asyncio.run(memory.start())
    return memory


def add(
    memory: InProcessMemory, namespace: str, vectors: npt.NDArray[np.float32], ids: list[str]
) -> Any:
    async def run() -> Any:
        return await memory.compare(namespace, list(vectors), ids, add=True)

    return asyncio.run(run())


def exported(memory: InProcessMemory, namespace: str = DEFAULT_NAMESPACE) -> CacheEntries:
    async def run() -> list[CacheEntries]:
        return [chunk async for chunk in memory.export_chunks(namespace)]

    chunks = asyncio.run(run())
    if not chunks:
        return CacheEntries(np.empty((0, 384), np.float32), np.empty(0), [])
    return CacheEntries(
        np.concatenate([c.vectors for c in chunks]),
        np.concatenate([c.added_at_ms for c in chunks]),
        [i for c in chunks for i in c.ids()],
    )


def close(memory: InProcessMemory) -> None:
    asyncio.run(memory.close())


# ── the database ────────────────────────────────────────────────────────────


def test_every_namespace_survives_a_restart_with_its_order_and_capacity(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    v = random_units(12, seed=1)
    memory = memory_at(path, capacity=4)
    answers = add(memory, DEFAULT_NAMESPACE, v[:6], [f"d{i}" for i in range(6)])
    assert all(a.stored and a.not_stored is None for a in answers)
    add(memory, "team-a", v[6:8], ["a0", "a1"])
    imported = CacheEntries(
        v[8:12], np.array([1.0, 2.0, 3.0, 4.0]) + 1.7e12, ["b0", "b1", "b2", "b3"]
    )
    assert asyncio.run(memory.import_entries("team-b", imported)) == (4, 0)
    assert asyncio.run(memory.clear("team-a")) == 2
    before = exported(memory)
    close(memory)
    assert path.read_bytes()[:16] == b"SQLite format 3\x00"

    again = memory_at(path, capacity=4)
    try:
        assert asyncio.run(again.namespaces()) == [DEFAULT_NAMESPACE, "team-b"]
        after = exported(again)
        assert list(after.ids()) == ["d2", "d3", "d4", "d5"]  # the capacity's newest
        assert np.array_equal(after.vectors, before.vectors)
        assert np.array_equal(after.added_at_ms, before.added_at_ms)
        assert list(exported(again, "team-b").ids()) == ["b0", "b1", "b2", "b3"]
        assert again.store is not None
        assert again.store.status.state == "loaded"
        # The database holds no more than the memory: evicted rows were trimmed.
        assert again.store.rows(DEFAULT_NAMESPACE) == 4
        (seen,) = add(again, DEFAULT_NAMESPACE, v[5:6], ["d5-again"])
        assert seen.nearest is not None
        assert seen.nearest.trace_id == "d5"
    finally:
        close(again)


def test_the_wal_is_checkpointed_while_traces_commit_one_by_one(tmp_path: Path) -> None:
    """At `process` a small namespace's commits run on the event loop and SQLite's own
    checkpoints are off; the memory runs them on its thread instead: the WAL stays near
    1,000 pages (SQLite's default) and the entries reach the database file."""
    path = tmp_path / "memory.db"
    memory = memory_at(path, capacity=5_000)
    v = random_units(1_500, seed=8)

    async def run() -> None:
        for i in range(1_500):
            (c,) = await memory.compare(DEFAULT_NAMESPACE, [v[i]], [f"t{i}"], add=True)
            assert c.stored

    try:
        asyncio.run(run())
        wal = Path(f"{path}-wal").stat().st_size
        # 1,500 commits of three 4 KiB pages or so: 19 MB of WAL without checkpoints.
        assert wal < 8 * 2**20, wal
        assert path.stat().st_size > 1_000 * 1_536, path.stat().st_size
    finally:
        close(memory)
    again = memory_at(path, capacity=5_000)
    try:
        assert exported(again).ids() == [f"t{i}" for i in range(1_500)]
    finally:
        close(again)


def test_a_smaller_capacity_or_an_expired_entry_is_not_loaded(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    memory = memory_at(path, capacity=10)
    add(memory, DEFAULT_NAMESPACE, random_units(6, seed=2), [f"t{i}" for i in range(6)])
    close(memory)
    smaller = memory_at(path, capacity=3)
    assert list(exported(smaller).ids()) == ["t3", "t4", "t5"]
    assert smaller.store is not None
    assert smaller.store.rows(DEFAULT_NAMESPACE) == 3
    close(smaller)
    expired = memory_at(path, capacity=10, ttl_ms=1.0, clock_ms=lambda: 4e12)
    assert expired.size == 0
    close(expired)


def test_a_write_that_fails_is_answered_as_not_stored_and_not_kept(tmp_path: Path) -> None:
    """A database that cannot be opened (its directory is gone): scoring goes on, the trace is
    compared with the memory, not kept, and the answer says why."""
    memory = memory_at(tmp_path / "gone" / "memory.db")
    try:
        (first,) = add(memory, DEFAULT_NAMESPACE, random_units(1, seed=3), ["t0"])
        assert (first.stored, first.max_cosine) == (False, None)
        assert first.not_stored in ("unable to open database file", "No such file or directory")
        assert memory.size == 0
        assert memory.store is not None
        assert memory.store.status.write_errors_total == 1
        assert any(str(first.not_stored) in w for w in memory.health().warnings)
        assert not memory.health().degraded
    finally:
        close(memory)


def test_a_start_that_prefaults_the_rings_loads_the_same_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rings prefaulted beside the load (from any size here, a few rows at a time): every
    entry where the load put it, in order."""
    monkeypatch.setattr(in_process, "PREFAULT_FROM", 1)
    monkeypatch.setattr(in_process, "PREFAULT_BLOCK", 3)
    path = tmp_path / "memory.db"
    v = random_units(300, seed=8)
    memory = memory_at(path, capacity=1000)
    add(memory, "ns-a", v[:200], [f"a{i}" for i in range(200)])
    add(memory, "ns-b", v[200:], [f"b{i}" for i in range(100)])
    close(memory)

    again = memory_at(path, capacity=1000)
    try:
        assert np.array_equal(exported(again, "ns-a").vectors, v[:200])
        assert list(exported(again, "ns-b").ids()) == [f"b{i}" for i in range(100)]
        assert np.array_equal(exported(again, "ns-b").vectors, v[200:])
    finally:
        close(again)


def _vector_offset(path: Path, vector: npt.NDArray[np.float32]) -> int:
    data = path.read_bytes()
    at = data.find(np.ascontiguousarray(vector, "<f4").tobytes())
    assert at > 0
    return at


def _change_four_bytes(path: Path, at: int) -> None:
    with path.open("r+b") as f:
        f.seek(at)
        old = f.read(4)
        f.seek(at)
        f.write(bytes(b ^ 0x5A for b in old))


def test_four_bytes_changed_inside_a_stored_vector_drop_that_entry_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SQLite's check passes (the file's structure is whole); the entry's checksum does not:
    it is never served, the rest are, and /readyz, the log and the counter say so."""
    path = tmp_path / "memory.db"
    v = random_units(30, seed=4)
    memory = memory_at(path)
    add(memory, DEFAULT_NAMESPACE, v, [f"t{i}" for i in range(30)])
    close(memory)
    _change_four_bytes(path, _vector_offset(path, v[15]) + 700)

    with caplog.at_level(logging.ERROR, logger="app.memory.sqlite"):
        again = memory_at(path)
    try:
        assert again.store is not None
        assert again.store.status.checksum_failures_total == 1
        kept = exported(again)
        assert list(kept.ids()) == [f"t{i}" for i in range(30) if i != 15]
        assert np.array_equal(kept.vectors, np.delete(v, 15, axis=0))
        assert any("failed their checksum" in w for w in again.health().warnings)
        assert "1 entries failed their checksum" in caplog.text
    finally:
        close(again)
    # Dropped from the file too: the next start finds nothing wrong.
    third = memory_at(path)
    assert third.store is not None
    assert third.store.status.checksum_failures_total == 0
    assert third.size == 29
    close(third)


@pytest.mark.parametrize(
    ("field", "where"),
    [
        ("namespace", lambda ns, tid: 0),
        ("trace id", lambda ns, tid: len(ns) + 3),
        ("time", lambda ns, tid: len(ns) + len(tid) + 6),  # the REAL's low bytes
        ("vector's first byte", lambda ns, tid: len(ns) + len(tid) + 8),
        ("vector's last byte", lambda ns, tid: len(ns) + len(tid) + 8 + 384 * 4 - 1),
        ("checksum", lambda ns, tid: len(ns) + len(tid) + 8 + 384 * 4 + 5),
    ],
)
def test_a_byte_changed_in_any_field_of_a_row_drops_that_row_only(
    tmp_path: Path, field: str, where: Any
) -> None:
    """One bit of one byte of a row changed in the file (the row's record: namespace, trace
    id, time, vector, checksum, side by side): the checksum catches it, whichever field."""
    path = tmp_path / "memory.db"
    v = random_units(40, seed=5)
    memory = memory_at(path)
    add(memory, "ns-a", v[:20], [f"a{i:03}" for i in range(20)])
    add(memory, "ns-b", v[20:], [f"b{i:03}" for i in range(20)])
    close(memory)
    data = path.read_bytes()
    record = data.find(b"ns-bb007")  # the namespace and the trace id, side by side
    assert record > 0
    assert data.find(b"ns-bb007", record + 1) < 0
    at = record + where("ns-b", "b007")
    assert data[record + 8 + 8 : record + 16 + 384 * 4] == v[27].astype("<f4").tobytes()
    with path.open("r+b") as f:
        f.seek(at)
        f.write(bytes([data[at] ^ 0x01]))

    again = memory_at(path)
    try:
        assert again.store is not None
        assert again.store.status.checksum_failures_total == 1, field
        assert list(exported(again, "ns-b").ids()) == [f"b{i:03}" for i in range(20) if i != 7]
        assert np.array_equal(exported(again, "ns-b").vectors, np.delete(v[20:], 7, axis=0))
        assert list(exported(again, "ns-a").ids()) == [f"a{i:03}" for i in range(20)]
    finally:
        close(again)


def test_a_name_changed_into_bytes_that_are_not_utf8_costs_that_row_only(
    tmp_path: Path,
) -> None:
    """SQLite cannot hand the row's trace id over as text: the file is read row by row, as a
    damaged one, and every other row is kept."""
    path = tmp_path / "memory.db"
    v = random_units(20, seed=6)
    memory = memory_at(path)
    add(memory, "ns-b", v, [f"b{i:03}" for i in range(20)])
    close(memory)
    data = path.read_bytes()
    record = data.find(b"ns-bb007")
    with path.open("r+b") as f:
        f.seek(record + 5)
        f.write(b"\xff")

    again = memory_at(path)
    try:
        assert again.store is not None
        assert again.store.status.state == "recovered"
        assert list(exported(again, "ns-b").ids()) == [f"b{i:03}" for i in range(20) if i != 7]
    finally:
        close(again)


def _btree_page_in_the_middle(path: Path) -> int:
    """The offset of the table page nearest the middle of the file (its header's first
    bytes: the page type, the first freeblock)."""
    data = path.read_bytes()
    page = int.from_bytes(data[16:18], "big")
    middle = len(data) // 2 // page
    for number in [middle + k for k in range(50)] + [middle - k for k in range(1, 50)]:
        if data[number * page] == 0x0D:  # a table leaf page
            return number * page
    raise AssertionError("no table page near the middle")


def test_four_bytes_changed_in_a_page_in_the_middle_are_copied_aside_and_the_rest_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The file fails SQLite's check: it is copied aside byte for byte (never deleted), what
    can be read is kept in a new database, and the log and /readyz say how many."""
    path = tmp_path / "memory.db"
    v = random_units(400, seed=5)
    memory = memory_at(path, capacity=1000)
    for start in range(0, 400, 50):  # several transactions, as traces come
        add(
            memory,
            DEFAULT_NAMESPACE,
            v[start : start + 50],
            [f"t{i}" for i in range(start, start + 50)],
        )
    close(memory)
    _change_four_bytes(path, _btree_page_in_the_middle(path))
    damaged = path.read_bytes()

    with caplog.at_level(logging.ERROR, logger="app.memory.sqlite"):
        again = memory_at(path, capacity=1000)
    try:
        assert again.store is not None
        status = again.store.status
        assert status.state == "recovered"
        asides = list(tmp_path.glob("memory.db.damaged-*"))
        assert [
            p.read_bytes() == damaged for p in asides if not p.name.endswith(("-wal", "-shm"))
        ] == [True]
        kept = exported(again)
        # Whatever is served is what was stored; a page holds a few entries at most.
        index = {f"t{i}": i for i in range(400)}
        assert np.array_equal(kept.vectors, v[[index[i] for i in kept.ids()]])
        assert 400 - 10 <= len(kept.ids()) < 400
        assert f"{len(kept.ids())} entries kept" in (status.detail or "")
        assert any("recovered" in w for w in again.health().warnings)
        assert '"kept"' in caplog.text or "kept" in caplog.text
        add(again, DEFAULT_NAMESPACE, random_units(1, seed=6), ["after"])  # writable again
    finally:
        close(again)
    third = memory_at(path, capacity=1000)
    assert third.store is not None
    assert third.store.status.state == "loaded"
    assert third.size == len(kept.ids()) + 1
    close(third)


def test_a_database_of_another_model_is_set_aside(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    memory = memory_at(path)
    add(memory, DEFAULT_NAMESPACE, random_units(2, seed=7), ["a", "b"])
    close(memory)
    store = SqliteStore(path, "another-model", 384, "process")
    other = InProcessMemory(100, store=store)
    asyncio.run(other.start())
    assert other.size == 0
    assert store.status.state == "set_aside"
    assert len(list(tmp_path.glob("memory.db.other_model-*"))) == 1
    close(other)


# ── an operator's mistakes while serving ────────────────────────────────────


def _row_ids(path: Path) -> list[str]:
    """The trace ids in the database file as SQLite reads it (a copy: nothing of it moves)."""
    import sqlite3

    copy = path.with_name("reading.db")
    shutil.copyfile(path, copy)
    wal = Path(f"{path}-wal")
    if wal.exists():
        shutil.copyfile(wal, Path(f"{copy}-wal"))
    conn = sqlite3.connect(copy)
    try:
        return [r[0] for r in conn.execute("SELECT trace_id FROM entries ORDER BY id")]
    finally:
        conn.close()
        for each in (copy, Path(f"{copy}-wal"), Path(f"{copy}-shm")):
            each.unlink(missing_ok=True)


@pytest.mark.parametrize("watch", ["kernel", "paths"])
@pytest.mark.parametrize("removed", ["memory.db-wal", "memory.db"])
def test_a_file_deleted_while_serving_is_noticed_before_the_next_commit_is_claimed(
    tmp_path: Path, removed: str, watch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The WAL holds every commit since the last checkpoint (all of them here): deleting it,
    or the database, would take them along. The next commit finds the file gone before its
    answer and writes everything the memory holds into a new file at the path first. Told by
    the kernel (inotify), or, where there is none, by the paths compared at each commit."""
    if watch == "paths":
        monkeypatch.setattr(sqlite, "file_watch", lambda paths: None)
    path = tmp_path / "memory.db"
    v = random_units(40, seed=21)
    memory = memory_at(path)
    try:
        assert all(c.stored for c in add(memory, "ns-a", v[:10], [f"a{i}" for i in range(10)]))
        assert all(c.stored for c in add(memory, "ns-b", v[10:20], [f"b{i}" for i in range(10)]))
        (tmp_path / removed).unlink()
        after = add(memory, "ns-a", v[20:40], [f"c{i}" for i in range(20)])
        assert all(c.stored for c in after)
        assert memory.store is not None
        assert (memory.store._watch is None) == (watch == "paths")
        assert memory.store.status.rewrites_total == 1
        assert any("written anew" in w for w in memory.health().warnings)
        # What the files at the path hold now, without the process's help.
        expected_a = [f"a{i}" for i in range(10)] + [f"c{i}" for i in range(20)]
        assert sorted(_row_ids(path)) == sorted(expected_a + [f"b{i}" for i in range(10)])
    finally:
        close(memory)
    again = memory_at(path)
    try:
        assert list(exported(again, "ns-a").ids()) == expected_a
        assert list(exported(again, "ns-b").ids()) == [f"b{i}" for i in range(10)]
    finally:
        close(again)


def test_a_database_replaced_while_serving_is_moved_aside_and_written_anew(
    tmp_path: Path,
) -> None:
    """An operator's copy put in place of the database (a backup restored without stopping
    the service): kept beside it, never deleted; the path gets the memory's entries."""
    path = tmp_path / "memory.db"
    v = random_units(6, seed=22)
    memory = memory_at(path)
    try:
        add(memory, DEFAULT_NAMESPACE, v[:3], ["t0", "t1", "t2"])
        other = tmp_path / "other.db"
        other.write_bytes(b"an operator's file")
        os.replace(other, path)
        assert all(c.stored for c in add(memory, DEFAULT_NAMESPACE, v[3:], ["t3", "t4", "t5"]))
        (aside,) = tmp_path.glob("memory.db.replaced-*")
        assert aside.read_bytes() == b"an operator's file"
        assert memory.store is not None
        assert aside.name in memory.store.health().warnings[0]
    finally:
        close(memory)
    again = memory_at(path)
    try:
        assert list(exported(again).ids()) == [f"t{i}" for i in range(6)]
    finally:
        close(again)


def test_a_database_that_cannot_be_opened_warns_from_the_start_and_is_tried_again(
    tmp_path: Path,
) -> None:
    """Its directory does not exist yet: /readyz warns before any trace; once it exists, the
    next trace is stored, with no restart."""
    path = tmp_path / "later" / "memory.db"
    memory = memory_at(path)
    try:
        assert memory.store is not None
        assert memory.store.status.state == "error"
        assert any("cannot be opened" in w for w in memory.health().warnings)
        (first,) = add(memory, DEFAULT_NAMESPACE, random_units(1, seed=23), ["t0"])
        assert not first.stored
        path.parent.mkdir()
        (second,) = add(memory, DEFAULT_NAMESPACE, random_units(1, seed=24), ["t1"])
        assert second.stored
        assert memory.store.status.state == "none"
        assert not any("cannot" in w for w in memory.health().warnings)
    finally:
        close(memory)
    again = memory_at(path)
    try:
        assert list(exported(again).ids()) == ["t1"]
    finally:
        close(again)


def test_a_directory_as_the_path_warns_before_any_trace(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    path.mkdir()
    memory = memory_at(path)
    try:
        (warning,) = memory.health().warnings
        assert warning.startswith("cache database cannot be opened")
        assert memory.store is not None
        assert memory.store.status.failing
    finally:
        close(memory)


def test_a_second_owner_of_a_database_is_refused_naming_the_first(tmp_path: Path) -> None:
    """One process owns a database: a second memory on it (here in this same process) is
    refused at start, with the owner's PID and host, and the file is not touched."""
    path = tmp_path / "memory.db"
    first = memory_at(path)
    try:
        add(first, DEFAULT_NAMESPACE, random_units(1, seed=25), ["t0"])
        before = path.read_bytes()
        with pytest.raises(SystemExit, match=rf"KP_CACHE_DB_PATH: .*process {os.getpid()} on host"):
            memory_at(path)
        assert path.read_bytes() == before
    finally:
        close(first)
    again = memory_at(path)  # the lock went with the first memory
    close(again)


def test_a_schema_newer_than_this_release_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "memory.db"
    memory = memory_at(path)
    add(memory, DEFAULT_NAMESPACE, random_units(2, seed=26), ["t0", "t1"])
    close(memory)
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET value = '3' WHERE key = 'schema'")
    conn.execute("ALTER TABLE entries ADD COLUMN shard INTEGER")
    conn.commit()
    conn.close()
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    with pytest.raises(SystemExit, match="has schema 3, newer than this release's 2"):
        memory_at(path)
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert {k: v for k, v in after.items() if not k.endswith((".lock", "-shm"))} == {
        k: v for k, v in before.items() if not k.endswith((".lock", "-shm"))
    }


def test_expired_namespaces_are_let_go_and_their_rows_deleted(tmp_path: Path) -> None:
    """Every entry of a namespace expired: it no longer counts against KP_MAX_NAMESPACES, its
    ring is given back and its rows leave the database; the eviction counter never falls."""
    path = tmp_path / "memory.db"
    now = [1.7e12]
    memory = memory_at(path, capacity=2, ttl_ms=1000.0, max_namespaces=3, clock_ms=lambda: now[0])
    try:
        v = random_units(12, seed=27)
        for i, ns in enumerate(("ns-a", "ns-b", "ns-c")):
            add(memory, ns, v[3 * i : 3 * i + 3], [f"{ns}-{k}" for k in range(3)])
        evictions = memory.evictions_total
        assert evictions == 3
        with pytest.raises(in_process.NamespaceLimitError):
            add(memory, "ns-d", v[9:10], ["d0"])
        now[0] += 1500.0  # every entry expired
        memory._next_forget = 0.0  # the memory's next look is due
        assert all(c.stored for c in add(memory, "ns-d", v[9:10], ["d0"]))
        assert set(memory._caches) == {"ns-d"}
        assert memory.evictions_total == evictions
        assert memory.store is not None
        assert {ns: memory.store.rows(ns) for ns in ("ns-a", "ns-b", "ns-c")} == dict.fromkeys(
            ("ns-a", "ns-b", "ns-c"), 0
        )
        assert _row_ids(path) == ["d0"]
    finally:
        close(memory)


# ── the former files ────────────────────────────────────────────────────────


def _former_at(directory: Path) -> Path:
    for each in FORMER.glob("memory.kpcache*"):
        shutil.copyfile(each, directory / each.name)
    return directory / "memory.kpcache"


def test_the_former_snapshot_and_journal_are_converted_once(
    make_client: ClientFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Files made by the former release (a snapshot of three traces and a journal of two
    more): read into the database at the same path, kept beside it, under the former setting
    names (with a deprecation warning)."""
    monkeypatch.delenv("KP_CACHE_DB_PATH")  # the new name would win over the former one
    path = _former_at(tmp_path)
    former = path.read_bytes()
    with caplog.at_level(logging.WARNING):
        client = make_client(cache_snapshot_path=path, cache_journal_fsync="always")
    ready = client.get("/readyz").json()["storage"]
    assert (ready["state"], ready["loaded_vectors"], ready["durability"]) == (
        "converted",
        5,
        "power",
    )
    assert "KP_CACHE_SNAPSHOT_PATH is deprecated" in caplog.text
    assert "KP_CACHE_JOURNAL_FSYNC is deprecated" in caplog.text
    assert path.read_bytes()[:16] == b"SQLite format 3\x00"
    assert (tmp_path / "memory.kpcache.old-format").read_bytes() == former
    assert (tmp_path / "memory.kpcache.journal.000001.old-format").exists()
    lines = [orjson.loads(line) for line in client.get("/cache/export").text.splitlines()]
    expected = [orjson.loads(line) for line in (FORMER / "export.ndjson").read_text().splitlines()]
    assert lines == expected
    repeat = client.post("/evaluate", json=make_trace(objective="Plan a trip to Kyoto")).json()
    assert repeat["novelty"]["nearest"]["trace_id"] == "kp:trace:old-0"
    client.__exit__(None, None, None)

    again = make_client(cache_db_path=path)
    assert again.get("/readyz").json()["storage"]["state"] == "loaded"
    assert again.get("/cache").json()["size"] == 6


def test_a_former_snapshot_of_another_model_is_kept_and_the_way_named(
    make_client: ClientFactory, tmp_path: Path
) -> None:
    path = _former_at(tmp_path)
    data = bytearray(path.read_bytes())
    at = data.find(b"minilm-l6-v2")
    data[at : at + 6] = b"MINILM"
    path.write_bytes(bytes(data))
    client = make_client(cache_db_path=path)
    ready = client.get("/readyz").json()
    assert ready["storage"]["state"] == "set_aside"
    assert any("POST /cache/import" in w for w in ready["warnings"])
    assert (tmp_path / "memory.kpcache.old-format").read_bytes() == bytes(data)
    assert client.get("/cache").json()["size"] == 0


# ── settings ────────────────────────────────────────────────────────────────


def test_the_former_setting_names_still_work_for_one_release(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KP_CACHE_DB_PATH")  # the new name would win over the former one
    old = Settings(cache_snapshot_path=Path("/data/m.db"), cache_journal_fsync="everysec")
    assert (old.cache_db_path, old.cache_durability) == (Path("/data/m.db"), "process")
    assert Settings(cache_journal_fsync="always").cache_durability == "power"
    assert Settings(cache_journal_fsync="off").cache_durability == "process"
    new_wins = Settings(cache_db_path=Path("/a.db"), cache_snapshot_path=Path("/b.db"))
    assert new_wins.cache_db_path == Path("/a.db")
    assert len(Settings(cache_snapshot_interval_s=5).deprecation_warnings()) == 1
    assert Settings().deprecation_warnings() == []


def test_the_memory_is_kept_in_the_user_s_data_directory_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The default keeps its word: a file in the user's data directory; `:memory:` keeps the
    memory in the process only; a shared memory or no model has no file unless one is named
    (and then it is refused, as before)."""
    monkeypatch.delenv("KP_CACHE_DB_PATH")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert Settings().cache_db_path == tmp_path / "data" / "kp-scoring" / "memory.db"
    assert _from_env({"KP_CACHE_DB_PATH": ""}).cache_db_path == Settings().cache_db_path
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    expected = tmp_path / "home" / ".local" / "share" / "kp-scoring" / "memory.db"
    assert Settings().cache_db_path == expected
    assert Settings(cache_db_path=":memory:").cache_db_path is None
    assert _from_env({"KP_CACHE_DB_PATH": ":memory:"}).cache_db_path is None
    assert Settings(embedder="none").cache_db_path is None
    redis = "redis://127.0.0.1:6379/0"
    assert Settings(redis_url=redis).cache_db_path is None
    assert Settings(redis_url=redis, cache_db_path=":memory:").cache_db_path is None
    with pytest.raises(SystemExit, match="KP_CACHE_DB_PATH and KP_REDIS_URL are both set"):
        _from_env({"KP_REDIS_URL": redis, "KP_CACHE_DB_PATH": "/data/m.db"})


def test_a_path_without_a_model_is_refused_at_start_with_the_reason() -> None:
    with pytest.raises(SystemExit, match="KP_CACHE_DB_PATH is set with KP_EMBEDDER=none"):
        _from_env({"KP_EMBEDDER": "none", "KP_CACHE_DB_PATH": "/data/m.db"})


def _from_env(env: dict[str, str]) -> Settings:
    saved = {k: v for k, v in os.environ.items() if k.startswith("KP_")}
    for k in saved:
        del os.environ[k]
    os.environ.update(env)
    try:
        return Settings.from_env()
    finally:
        for k in env:
            del os.environ[k]
        os.environ.update(saved)


# ── live servers: kill -9, a full disk ─────────────────────────────────────


def _server(path: Path, log: Path, **env: str) -> LiveServer:
    return LiveServer({"KP_CACHE_DB_PATH": str(path), "KP_EMBEDDER_PRELOAD": "true", **env}, log)


def _ids_in(server: LiveServer) -> list[str]:
    text = server.client.get("/cache/export").text
    return [orjson.loads(line)["trace_id"] for line in text.splitlines()]


@pytest.mark.server
@pytest.mark.parametrize("durability", ["process", "power"])
def test_kill_9_right_after_the_answers_keeps_every_stored_trace(
    tmp_path: Path, durability: str
) -> None:
    path = tmp_path / "memory.db"
    server = _server(path, tmp_path / "server.log", KP_CACHE_DURABILITY=durability)
    ids = []
    try:
        for i in range(12):
            trace = make_trace(trace_id=f"kp:trace:k{i}", objective=f"kill nine topic {i}")
            novelty = server.post("/evaluate", trace).json()["novelty"]
            assert novelty["stored"] is True
            ids.append(trace["id"])
        batch = [
            make_trace(trace_id=f"kp:trace:b{i}", objective=f"batch topic {i}") for i in range(4)
        ]
        results = server.post("/evaluate/batch", {"traces": batch}).json()["results"]
        assert all(r["novelty"]["stored"] for r in results)
        ids += [t["id"] for t in batch]
    finally:
        server.stop(signal.SIGKILL)  # at once: no shutdown, nothing flushed after the answers
    again = _server(path, tmp_path / "server.log", KP_CACHE_DURABILITY=durability)
    try:
        assert _ids_in(again) == ids
    finally:
        again.stop()


def _log_line(server: LiveServer, msg: str) -> dict[str, Any]:
    lines = [orjson.loads(line) for line in server.log_path.read_text().splitlines()]
    found: list[dict[str, Any]] = [line for line in lines if line.get("msg") == msg]
    assert found, f"no {msg!r} line in {server.log()}"
    return found[-1]


@pytest.mark.server
def test_a_default_service_stopped_and_started_again_holds_its_memory_and_says_so(
    tmp_path: Path,
) -> None:
    """As `make run` starts it (no KP_CACHE_DB_PATH): the memory is kept in the user's data
    directory, made at the first start; the start line says where the service listens, where
    the memory is and what it loaded, the stop line what it kept."""
    data = tmp_path / "data"
    env = {"KP_CACHE_DB_PATH": "", "XDG_DATA_HOME": str(data), "KP_LOG_LEVEL": "info"}
    database = data / "kp-scoring" / "memory.db"
    first = LiveServer(env, tmp_path / "first.log")
    try:
        answers = [first.post("/evaluate", make_trace(objective=f"topic {i}")) for i in (1, 2)]
        assert all(a.json()["novelty"]["stored"] for a in answers)
        started = _log_line(first, "kp-scoring started")
        # As getting-started.md and persistence.md show the line.
        shown = ["ts", "level", "logger", "msg", "url", "embedder", "cache_capacity"]
        assert list(started) == [*shown, "memory", "entries"]
        assert started["url"] == first.url
        assert (started["memory"], started["entries"]) == (f"SQLite {database}", 0)
    finally:
        assert first.stop() == 0
    stopped = _log_line(first, "kp-scoring stopped")
    assert list(stopped) == ["ts", "level", "logger", "msg", "memory", "kept", "namespaces"]
    assert (stopped["memory"], stopped["kept"], stopped["namespaces"]) == (
        f"SQLite {database}",
        2,
        1,
    )
    assert database.stat().st_size > 0
    assert (database.parent.stat().st_mode & 0o777) == 0o700
    again = LiveServer(env, tmp_path / "again.log")
    try:
        assert again.client.get("/cache").json()["size"] == 2
        assert _log_line(again, "kp-scoring started")["entries"] == 2
    finally:
        again.stop()


@pytest.mark.server
def test_a_memory_kept_in_the_process_only_is_said_lost_at_stop(tmp_path: Path) -> None:
    env = {"KP_CACHE_DB_PATH": ":memory:", "KP_LOG_LEVEL": "info"}
    env["XDG_DATA_HOME"] = str(tmp_path / "data")
    server = LiveServer(env, tmp_path / "server.log")
    try:
        assert server.post("/evaluate", make_trace()).json()["novelty"]["stored"] is True
        started = _log_line(server, "kp-scoring started")
        assert started["memory"] == "the process only (nothing is kept when it stops)"
    finally:
        server.stop()
    stopped = _log_line(server, "kp-scoring stopped")
    assert (stopped["kept"], stopped["dropped"]) == (0, 1)
    assert not (tmp_path / "data").exists()


@contextlib.contextmanager
def _tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"a small tmpfs cannot be mounted here ({done.stderr.strip()}): needs root")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(directory: Path) -> Path:
    """A file that takes the file system's last byte."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for block in (1 << 20, 1 << 12, 1):
            while True:
                try:
                    os.write(fd, b"\0" * block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    return filler


@pytest.mark.server
def test_a_full_disk_is_answered_as_not_stored_and_what_follows_survives_kill_9(
    tmp_path: Path,
) -> None:
    """The data directory on a small tmpfs filled to its last byte: every trace is scored
    (200, novelty measured), those that could not be committed say so and are not kept;
    /readyz warns from the first failure, not degraded, and stops once space is back; the
    counter counts; after kill -9 exactly the traces answered as stored are there."""
    disk = tmp_path / "disk"
    with _tmpfs(disk, "16m"):
        path = disk / "memory.db"
        server = _server(path, tmp_path / "server.log")
        stored: list[str] = []
        try:

            def post(name: str) -> dict[str, Any]:
                trace = make_trace(trace_id=f"kp:trace:{name}", objective=f"full disk topic {name}")
                r = server.post("/evaluate", trace)
                assert r.status_code == 200
                novelty: dict[str, Any] = r.json()["novelty"]
                if novelty["stored"]:
                    stored.append(trace["id"])
                return novelty

            for i in range(3):
                assert post(f"before{i}")["stored"]
            filler = _fill(disk)
            refused = [post(f"full{i}") for i in range(20)]
            failed = [n for n in refused if not n["stored"]]
            assert failed, "every commit found room on a full disk"
            for n in failed:
                assert n["not_stored"] == "storage_failed"
                assert n["not_stored_detail"] == "database or disk is full"
                assert n["measured"] is True  # scored against what is in memory
            ready = server.client.get("/readyz").json()
            assert ready["status"] == "ready"
            assert not ready["degraded"]
            assert any("database or disk is full" in w for w in ready["warnings"])
            storage, snapshot = ready["storage"], ready["snapshot"]
            assert storage["write_errors_total"] == len(failed)
            assert storage["last_write_error"] == "database or disk is full"
            # The deprecated `snapshot` is the same under the former release's names.
            assert (snapshot["save_errors_total"], snapshot["last_save_error"]) == (
                storage["write_errors_total"],
                storage["last_write_error"],
            )
            assert snapshot["saves_total"] == storage["commits_total"] > 0
            metrics = server.client.get("/metrics").text
            assert f"kp_cache_db_write_errors_total {float(len(failed))}" in metrics
            size = server.client.get("/cache").json()["size"]
            assert size == len(stored)

            filler.unlink()
            after = [post(f"after{i}") for i in range(20)]
            assert all(n["stored"] for n in after)
            ready = server.client.get("/readyz").json()
            assert not any("not written" in w for w in ready["warnings"])
        finally:
            server.stop(signal.SIGKILL)
        again = _server(path, tmp_path / "server.log")
        try:
            assert _ids_in(again) == stored
        finally:
            again.stop()


def _poster(server: LiveServer, stored: list[str], prefix: str) -> Any:
    """POSTs one trace at a time; the ids answered as stored are appended to `stored`."""
    count = [0]

    def post() -> dict[str, Any]:
        i = count[0] = count[0] + 1
        trace = make_trace(trace_id=f"kp:trace:{prefix}{i}", objective=f"{prefix} topic {i}")
        r = server.post("/evaluate", trace)
        assert r.status_code == 200, r.text
        novelty: dict[str, Any] = r.json()["novelty"]
        if novelty["stored"]:
            stored.append(trace["id"])
        return novelty

    return post


def _metric(server: LiveServer, name: str) -> float:
    for line in server.client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name}")


@pytest.mark.server
@pytest.mark.parametrize("removed", ["memory.db-wal", "memory.db"])
def test_a_file_removed_while_serving_loses_no_answered_trace_after_kill_9(
    tmp_path: Path, removed: str
) -> None:
    """20 traces, `rm` of the WAL (or the database), 20 more, kill -9, a restart: all 40."""
    path = tmp_path / "memory.db"
    server = _server(path, tmp_path / "server.log")
    stored: list[str] = []
    post = _poster(server, stored, "rm")
    try:
        assert all(post()["stored"] for _ in range(20))
        (tmp_path / removed).unlink()
        assert all(post()["stored"] for _ in range(20))
        ready = server.client.get("/readyz").json()
        assert any("written anew" in w for w in ready["warnings"])
        assert _metric(server, "kp_cache_db_rewrites_total") == 1
    finally:
        server.stop(signal.SIGKILL)
    again = _server(path, tmp_path / "server.log")
    try:
        assert _ids_in(again) == stored
        assert len(stored) == 40
    finally:
        again.stop()


@pytest.mark.server
def test_a_second_process_on_the_database_is_refused_naming_the_first(tmp_path: Path) -> None:
    """A real second server on the same KP_CACHE_DB_PATH: refused before it serves, one line
    naming the first's PID; once the first is killed, it starts and finds every trace."""
    path = tmp_path / "memory.db"
    first = _server(path, tmp_path / "first.log")
    stored: list[str] = []
    try:
        post = _poster(first, stored, "own")
        assert all(post()["stored"] for _ in range(3))
        env = {k: v for k, v in os.environ.items() if not k.startswith("KP_")}
        env |= {"KP_CACHE_DB_PATH": str(path), "KP_LOG_LEVEL": "warning"}
        refusal = refused_start(env)
        assert "KP_CACHE_DB_PATH" in refusal
        assert f"process {first.process.pid} on host" in refusal
        assert all(post()["stored"] for _ in range(2))  # the first goes on
    finally:
        first.stop(signal.SIGKILL)  # the kernel lets go of its lock
    again = _server(path, tmp_path / "again.log")
    try:
        assert _ids_in(again) == stored
    finally:
        again.stop()


@pytest.mark.server
def test_a_database_from_a_later_release_stops_the_start_and_is_left_as_it_is(
    tmp_path: Path,
) -> None:
    import sqlite3

    path = tmp_path / "memory.db"
    server = _server(path, tmp_path / "server.log")
    try:
        _poster(server, [], "future")()
    finally:
        server.stop()
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema'")
    conn.execute("ALTER TABLE entries ADD COLUMN shard INTEGER")
    conn.commit()
    conn.close()
    before = path.read_bytes()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KP_")}
    env |= {"KP_CACHE_DB_PATH": str(path), "KP_LOG_LEVEL": "warning"}
    assert "has schema 99, newer than this release's 2" in refused_start(env)
    assert path.read_bytes() == before


@pytest.mark.server
def test_a_directory_as_the_path_warns_in_readyz_before_any_trace(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    path.mkdir()
    server = _server(path, tmp_path / "server.log")
    try:
        ready = server.client.get("/readyz").json()
        assert ready["storage"]["state"] == "error"
        assert any(w.startswith("cache database cannot be opened") for w in ready["warnings"])
        assert _metric(server, "kp_cache_db_failing") == 1
        novelty = _poster(server, [], "dir")()
        assert (novelty["stored"], novelty["not_stored"]) == (False, "storage_failed")
    finally:
        server.stop()


@pytest.mark.server
def test_a_start_on_a_full_disk_warns_and_stores_again_once_space_returns(
    tmp_path: Path,
) -> None:
    """A 2 MB tmpfs filled to its last byte, then a restart: /readyz warns from the start (the
    database cannot be opened) or from the first refused write; after `rm filler` the next
    trace is stored, with no restart; after kill -9 every trace answered as stored is there."""
    disk = tmp_path / "disk"
    with _tmpfs(disk, "2m"):
        path = disk / "memory.db"
        server = _server(path, tmp_path / "server.log")
        stored: list[str] = []
        post = _poster(server, stored, "full")
        try:
            assert all(post()["stored"] for _ in range(5))
        finally:
            server.stop()
        filler = _fill(disk)
        server = _server(path, tmp_path / "server.log")
        post = _poster(server, stored, "after")
        try:
            ready = server.client.get("/readyz").json()
            opened = ready["storage"]["state"] != "error"
            if not opened:
                assert any("cannot be opened" in w for w in ready["warnings"])
            refused = [post() for _ in range(5)]
            assert not any(n["stored"] for n in refused)
            ready = server.client.get("/readyz").json()
            # SQLite's reason: "database or disk is full", or "disk I/O error" when the WAL
            # index cannot be made.
            assert any(
                w.startswith(("cache database cannot be opened", "cache database not written"))
                for w in ready["warnings"]
            ), ready
            assert _metric(server, "kp_cache_db_failing") == 1
            filler.unlink()
            assert post()["stored"]
            assert all(post()["stored"] for _ in range(4))
            ready = server.client.get("/readyz").json()
            assert not any("cannot" in w or "not written" in w for w in ready["warnings"])
            assert _metric(server, "kp_cache_db_failing") == 0
        finally:
            server.stop(signal.SIGKILL)
        again = _server(path, tmp_path / "server.log")
        try:
            assert _ids_in(again) == stored
            assert len(stored) == 10
        finally:
            again.stop()
