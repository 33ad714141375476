"""The in-process memory (app/memory/in_process.py): one exact VectorCache per namespace, one
order for every change, and what an answer says about storing."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from app.memory.base import DEFAULT_NAMESPACE, Comparison, NamespaceLimitError
from app.memory.in_process import InProcessMemory, compare_pending
from app.memory.ring import CacheEntries, VectorCache
from app.memory.sqlite import SqliteStore

DIMS = 384


def unit_vectors(n: int, seed: int) -> npt.NDArray[np.float32]:
    v = np.random.default_rng(seed).standard_normal((n, DIMS))
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


def filled(memory: InProcessMemory, vectors: npt.NDArray[np.float32]) -> InProcessMemory:
    async def fill() -> None:
        ids = [f"t{i}" for i in range(len(vectors))]
        entries = CacheEntries(vectors, np.arange(len(vectors), dtype=np.float64) + 1.0, ids)
        await memory.import_entries(DEFAULT_NAMESPACE, entries)

    asyncio.run(fill())
    return memory


class _HeldSearch:
    """Wraps a cache's `nearest` so that its first call blocks until released; records the
    threads the calls ran on."""

    def __init__(self, cache: VectorCache) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.threads: list[threading.Thread] = []
        original = cache.nearest

        def nearest(*args: Any, **kwargs: Any) -> Any:
            self.threads.append(threading.current_thread())
            if not self.entered.is_set():
                self.entered.set()
                # Long enough for any machine's thread hand-off; on the loop itself it is
                # never released and fails the call.
                assert self.release.wait(10)
            return original(*args, **kwargs)

        cache.nearest = nearest  # type: ignore[method-assign]


def _nearest_id(comparison: Comparison) -> str | None:
    return None if comparison.nearest is None else comparison.nearest.trace_id


def test_past_the_threshold_the_event_loop_does_not_wait_for_a_search() -> None:
    """A scan of a large namespace takes milliseconds: the event loop goes on with its other
    work while one runs (here, held until the loop has shown it is free), and the memory is
    still changed in the order asked: each of several compares of the same vector sees the
    one before it, and a clear asked between them comes between them."""
    size = 1_200
    memory = filled(
        InProcessMemory(2_000, off_loop_from=1_000, clock_ms=lambda: 10.0),
        unit_vectors(size, 5),
    )
    held = _HeldSearch(memory.cache(DEFAULT_NAMESPACE))
    probe = unit_vectors(1, 6)[0]
    ns = DEFAULT_NAMESPACE

    async def scenario() -> tuple[list[Comparison], int]:
        asked = [asyncio.ensure_future(memory.compare(ns, [probe], ["p0"], add=True))]
        asked += [
            asyncio.ensure_future(memory.compare(ns, [probe], [f"p{i}"], add=True)) for i in (1, 2)
        ]
        cleared = asyncio.ensure_future(memory.clear(ns))
        asked.append(asyncio.ensure_future(memory.compare(ns, [probe], ["p3"], add=True)))
        # This coroutine goes on while the first search is held on another thread.
        assert await asyncio.to_thread(held.entered.wait, 30)
        assert not asked[0].done()
        held.release.set()
        results = [one for (one,) in await asyncio.gather(*asked)]
        await memory.close()
        return results, await cleared

    (c0, c1, c2, c3), removed = asyncio.run(scenario())
    assert held.threads
    assert threading.main_thread() not in held.threads
    assert (c0.size, c1.size, c2.size) == (size, size + 1, size + 2)
    assert (_nearest_id(c1), _nearest_id(c2)) == ("p0", "p1")
    assert str(_nearest_id(c0)).startswith("t")
    assert c1.max_cosine == pytest.approx(1.0, abs=1e-6)
    assert removed == size + 3
    assert (c3.max_cosine, c3.size) == (None, 0)
    assert all(c.stored and c.not_stored is None for c in (c0, c1, c2, c3))


def test_below_the_threshold_a_compare_is_one_step_of_the_event_loop() -> None:
    """A small namespace is scanned on the loop itself (a scan of at most about a millisecond
    costs less than a thread's hand-off)."""
    memory = filled(InProcessMemory(100), unit_vectors(16, 5))
    held = _HeldSearch(memory.cache(DEFAULT_NAMESPACE))
    held.release.set()  # nothing to wait for

    async def scenario() -> None:
        await memory.compare(DEFAULT_NAMESPACE, unit_vectors(1, 6), ["p"], add=True)
        await memory.close()

    asyncio.run(scenario())
    assert held.threads == [threading.main_thread()]


def test_namespaces_are_memories_of_their_own() -> None:
    """A trace is compared with its namespace's entries only; each namespace has the
    capacity; a dry run stores nothing (stored false); a namespace is listed while it holds
    entries."""
    v = unit_vectors(4, 1)
    memory = InProcessMemory(2)

    async def scenario() -> None:
        (a,) = await memory.compare("a", [v[0]], ["a0"], add=True)
        assert (a.max_cosine, a.stored) == (None, True)
        (b,) = await memory.compare("b", [v[0]], ["b0"], add=True)
        assert b.max_cosine is None  # "a"'s entry is not in "b"
        (dry,) = await memory.compare("a", [v[0]], ["probe"], add=False)
        assert (_nearest_id(dry), dry.stored) == ("a0", False)
        (unseen,) = await memory.compare("c", [v[0]], ["probe"], add=False)
        assert unseen.max_cosine is None
        assert await memory.namespaces() == ["a", "b"]  # a dry run makes no namespace
        await memory.compare("a", v[1:4], ["a1", "a2", "a3"], add=True)
        assert (await memory.stats("a")).size == 2  # the capacity is per namespace
        assert (await memory.stats("b")).size == 1
        assert memory.size == 3
        assert memory.evictions_total == 2
        chunks = [c async for c in memory.export_chunks("a")]
        assert [list(c.ids()) for c in chunks] == [["a2", "a3"]]
        assert await memory.clear("b") == 1
        assert await memory.namespaces() == ["a"]
        assert await memory.clear("never") == 0

    asyncio.run(scenario())


def test_a_namespace_past_the_limit_is_refused_and_nothing_is_stored() -> None:
    v = unit_vectors(3, 2)
    memory = InProcessMemory(10, max_namespaces=2)

    async def scenario() -> None:
        await memory.compare("a", [v[0]], ["a"], add=True)
        await memory.compare("b", [v[1]], ["b"], add=True)
        with pytest.raises(NamespaceLimitError, match="KP_MAX_NAMESPACES"):
            await memory.compare("c", [v[2]], ["c"], add=True)
        entries = CacheEntries(v[:1], np.array([1.0]), ["x"])
        with pytest.raises(NamespaceLimitError):
            await memory.import_entries("c", entries)
        assert await memory.namespaces() == ["a", "b"]
        assert memory.size == 2
        await memory.compare("a", [v[2]], ["a2"], add=True)  # an existing one still takes more
        (dry,) = await memory.compare("c", [v[2]], ["dry"], add=False)  # a dry run is fine
        assert dry.max_cosine is None
        await memory.clear("b")
        await memory.compare("c", [v[2]], ["c"], add=True)  # room again
        assert await memory.namespaces() == ["a", "c"]

    asyncio.run(scenario())


def test_concurrent_adds_kept_in_a_database_equal_one_at_a_time_in_its_order(
    tmp_path: Path,
) -> None:
    """Adds queued together share a commit; each answer still equals adding the traces one
    at a time in the order they were committed, and that order is the database's."""
    v = unit_vectors(40, 8)
    memory = InProcessMemory(25, store=SqliteStore(tmp_path / "m.db", "m", DIMS, "process"))

    async def scenario() -> list[list[Comparison]]:
        await memory.start()
        asked = [
            memory.compare(DEFAULT_NAMESPACE, list(v[i : i + 2]), [f"t{i}", f"t{i}b"], add=True)
            for i in range(0, 40, 2)
        ]
        answers = await asyncio.gather(*asked)
        await memory.close()
        return answers

    answers = asyncio.run(scenario())
    assert all(c.stored for answer in answers for c in answer)
    again = InProcessMemory(25, store=SqliteStore(tmp_path / "m.db", "m", DIMS, "process"))
    asyncio.run(again.start())
    kept = [i for c in again.cache(DEFAULT_NAMESPACE).chunks() for i in c.ids()]
    asyncio.run(again.close())
    assert len(kept) == 25
    # Replayed one at a time in the order requests were asked (asyncio.gather starts them in
    # order, and the memory keeps the order asked).
    replay = VectorCache(25, DIMS)
    order = [(v[i + k], f"t{i}{'b' if k else ''}") for i in range(0, 40, 2) for k in (0, 1)]
    expected = []
    for x, t in order:
        expected += compare_pending(replay, [x], [t], [], stored=True)
        replay.add(x, trace_id=t)
    got = [c for answer in answers for c in answer]
    assert [(c.max_cosine, c.size, _nearest_id(c)) for c in got] == [
        (c.max_cosine, c.size, _nearest_id(c)) for c in expected
    ]
    assert kept == [t for _, t in order][-25:]
