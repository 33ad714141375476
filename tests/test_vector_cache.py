"""The vector cache (docs/scoring.md): eviction, TTL, exactness, thread safety."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.memory.ring import CHUNK, CacheEntries, VectorCache


class FakeClock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def unit(seed: int, dims: int = 384) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(dims).astype(np.float32)
    return v / np.linalg.norm(v)


def max_cosine(cache: VectorCache, q: np.ndarray) -> float:
    """The largest cosine with a cached vector, 0.0 when empty (as the score reads it)."""
    found = cache.nearest(q)
    return 0.0 if found is None else found.cosine


def entries(cache: VectorCache) -> CacheEntries:
    """The live entries oldest first, as an export reads them."""
    chunks = list(cache.chunks())
    return CacheEntries(
        np.concatenate([c.vectors for c in chunks]),
        np.concatenate([c.added_at_ms for c in chunks]),
        [i for c in chunks for i in c.ids()],
    )


def reference_max_cosine(vectors: list[np.ndarray], q: np.ndarray) -> float:
    """The reference's loop: double-precision dot and norms, running max from -1."""
    best = -1.0
    for v in vectors:
        a, b = v.astype(np.float64), q.astype(np.float64)
        denom = np.sqrt(a @ a) * np.sqrt(b @ b)
        sim = 0.0 if denom == 0 else float(a @ b / denom)
        best = max(best, sim)
    return best


def test_empty_cache_answers_zero() -> None:
    cache = VectorCache()
    assert cache.size == 0
    assert max_cosine(cache, unit(1)) == 0.0


def test_identical_vector_has_cosine_one() -> None:
    cache = VectorCache()
    cache.add(unit(1))
    assert max_cosine(cache, unit(1)) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("shape", [(383,), (385,), (2, 384), ()])
def test_wrong_dimensions_are_rejected(shape: tuple[int, ...]) -> None:
    cache = VectorCache()
    with pytest.raises(ValueError, match="384"):
        cache.add(np.zeros(shape, dtype=np.float32))
    assert cache.size == 0


def test_non_finite_vectors_are_rejected() -> None:
    v = unit(1)
    v[3] = np.nan
    cache = VectorCache()
    with pytest.raises(ValueError, match="non-finite"):
        cache.add(v)


def test_eviction_is_oldest_first() -> None:
    cache = VectorCache(capacity=3)
    for seed in range(5):
        cache.add(unit(seed))
    assert cache.size == 3
    kept = entries(cache).vectors
    np.testing.assert_array_equal(kept, np.vstack([unit(2), unit(3), unit(4)]))
    assert max_cosine(cache, unit(0)) < 0.5  # evicted
    assert max_cosine(cache, unit(4)) == pytest.approx(1.0)
    stats = cache.stats()
    assert (stats.adds_total, stats.evictions_total) == (5, 2)


def test_ttl_drops_expired_entries_before_any_query() -> None:
    clock = FakeClock()
    cache = VectorCache(ttl_ms=1000, clock_ms=clock)
    cache.add(unit(1))
    clock.now += 600
    cache.add(unit(2))
    clock.now += 399
    assert cache.size == 2
    clock.now += 1  # the first entry is now exactly ttl old: gone (the reference keeps > cutoff)
    assert cache.size == 1
    assert max_cosine(cache, unit(1)) < 0.5
    clock.now += 600
    assert max_cosine(cache, unit(2)) == 0.0
    assert cache.size == 0


def test_stats_report_ages_with_the_injected_clock() -> None:
    clock = FakeClock()
    cache = VectorCache(capacity=10, clock_ms=clock)
    cache.add(unit(1))
    clock.now += 250
    cache.add(unit(2))
    clock.now += 50
    stats = cache.stats()
    assert (stats.oldest_age_ms, stats.newest_age_ms) == (300, 50)
    assert stats.memory_bytes >= 2 * 384 * 4


def test_clear_reports_what_it_dropped() -> None:
    cache = VectorCache()
    for seed in range(4):
        cache.add(unit(seed))
    assert cache.clear() == 4
    assert cache.size == 0
    assert max_cosine(cache, unit(1)) == 0.0


def test_extend_keeps_the_newest_capacity_entries() -> None:
    cache = VectorCache(capacity=2)
    vectors = np.vstack([unit(s) for s in range(3)])
    cache.extend(vectors, np.array([1.0, 2.0, 3.0]), ["a", "b", "c"])
    np.testing.assert_array_equal(entries(cache).vectors, vectors[1:])
    with pytest.raises(ValueError, match="dimensions"):
        cache.extend(np.zeros((2, 10), dtype=np.float32), np.zeros(2), ["d", "e"])
    assert list(entries(cache).ids()) == ["b", "c"]


@settings(max_examples=60, deadline=None)
@given(
    seeds=st.lists(st.integers(0, 10_000), min_size=1, max_size=40),
    capacity=st.integers(1, 16),
    query=st.integers(0, 10_000),
)
def test_max_cosine_equals_the_reference_loop_through_wraparound(
    seeds: list[int], capacity: int, query: int
) -> None:
    cache = VectorCache(capacity=capacity, dimensions=16)
    for s in seeds:
        cache.add(unit(s, 16))
    kept = [unit(s, 16) for s in seeds[-capacity:]]
    q = unit(query, 16)
    assert max_cosine(cache, q) == pytest.approx(reference_max_cosine(kept, q), abs=1e-12)
    assert cache.size == len(kept)


@settings(max_examples=80, deadline=None)
@given(
    # Few distinct seeds: the same vector stored several times makes ties.
    seeds=st.lists(st.integers(0, 6), min_size=1, max_size=40),
    capacity=st.integers(1, 16),
    query=st.integers(0, 6),
    skip_oldest=st.integers(0, 3),
)
def test_nearest_names_the_newest_of_the_best_through_wraparound(
    seeds: list[int], capacity: int, query: int, skip_oldest: int
) -> None:
    """Which entry is named, full ring or not: the newest of those with the reference's
    maximal cosine (docs/scoring.md), and none of the `skip_oldest` oldest."""
    cache = VectorCache(capacity=capacity, dimensions=16)
    for i, s in enumerate(seeds):
        cache.add(unit(s, 16), trace_id=f"t{i}")
    kept = list(enumerate(seeds))[-capacity:][skip_oldest:]
    found = cache.nearest(unit(query, 16), skip_oldest=skip_oldest)
    if not kept:
        assert found is None
        return
    q = unit(query, 16)
    cosines = [reference_max_cosine([unit(s, 16)], q) for _, s in kept]
    best = max(cosines)
    newest = max(i for (i, _), c in zip(kept, cosines, strict=True) if c == best)
    assert found is not None
    assert found.cosine == pytest.approx(best, abs=1e-12)
    assert found.trace_id == f"t{newest}"


def test_scan_is_exact_at_full_capacity() -> None:
    cache = VectorCache(capacity=1000)
    vectors = [unit(s) for s in range(1200)]
    for v in vectors:
        cache.add(v)
    for q in (unit(5000), vectors[-1], vectors[100]):
        assert max_cosine(cache, q) == pytest.approx(
            reference_max_cosine(vectors[-1000:], q), abs=1e-12
        )


def test_concurrent_adds_and_queries_keep_the_cache_consistent() -> None:
    """Thread-safe when given a lock, as the memory gives one (without it the cache is for
    one thread)."""
    cache = VectorCache(capacity=50, lock=threading.RLock())
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for i in range(200):
                cache.add(unit(offset * 1000 + i))
                max_cosine(cache, unit(i))
                assert cache.size <= 50
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    stats = cache.stats()
    assert (stats.size, stats.adds_total, stats.evictions_total) == (50, 1600, 1550)


@pytest.mark.parametrize(("capacity", "before", "batch"), [(5, 3, 4), (10, 0, 25), (64, 64, 1)])
def test_extend_equals_adding_one_by_one(capacity: int, before: int, batch: int) -> None:
    """What a start's load, a committed group or an import does, in one copy."""
    rng = np.random.default_rng(capacity)
    vectors = rng.standard_normal((before + batch, 384)).astype(np.float32)
    times = np.sort(rng.uniform(0, 1e6, before + batch))
    times[2:4] = times[1]  # equal times stay in order
    clock = FakeClock()
    one, many = VectorCache(capacity, clock_ms=clock), VectorCache(capacity, clock_ms=clock)
    for i in range(before + batch):
        clock.now = times[i]
        one.add(vectors[i], f"t{i}")
    for i in range(before):
        clock.now = times[i]
        many.add(vectors[i], f"t{i}")
    many.extend(vectors[before:], times[before:], [f"t{i}" for i in range(before, before + batch)])
    a, b = entries(one), entries(many)
    np.testing.assert_array_equal(a.vectors, b.vectors)
    np.testing.assert_array_equal(a.added_at_ms, b.added_at_ms)
    assert list(a.ids()) == list(b.ids())
    assert (one.adds_total, one.evictions_total) == (many.adds_total, many.evictions_total)
    query = rng.standard_normal(384).astype(np.float32)
    assert one.nearest(query) == many.nearest(query)


def test_an_export_leaves_out_what_left_meanwhile_and_takes_in_nothing_added() -> None:
    capacity = 2 * CHUNK + 5
    rows = np.random.default_rng(0).standard_normal((capacity + 4200, 8)).astype(np.float32)
    times = np.arange(len(rows), dtype=np.float64)
    ids = [f"t{i}" for i in range(len(rows))]
    cache = VectorCache(capacity, dimensions=8)
    cache.extend(rows[:capacity], times[:capacity], ids[:capacity])
    chunks = cache.chunks()
    first = next(chunks)
    cache.extend(rows[capacity:], times[capacity:], ids[capacity:])  # the 4,200 oldest leave
    rest = list(chunks)
    assert list(first.ids()) == ids[:CHUNK]
    assert [list(c.ids()) for c in rest] == [ids[4200 : 2 * CHUNK], ids[2 * CHUNK : capacity]]
    np.testing.assert_array_equal(rest[0].vectors, rows[4200 : 2 * CHUNK])
    np.testing.assert_array_equal(rest[0].added_at_ms, times[4200 : 2 * CHUNK])


def test_prefaulting_writes_only_free_rows_and_leaves_the_entries_as_they_were() -> None:
    cache = VectorCache(capacity=1000, dimensions=8)
    cache.reserve(1000)
    rows = np.stack([unit(i, 8) for i in range(300)])
    cache.extend(rows[:100], np.arange(100, dtype=np.float64), [f"t{i}" for i in range(100)])
    while cache.prefault(64):
        pass
    cache.extend(
        rows[100:], np.arange(100, 300, dtype=np.float64), [f"t{i}" for i in range(100, 300)]
    )
    assert np.array_equal(entries(cache).vectors, rows)
    assert list(entries(cache).ids()) == [f"t{i}" for i in range(300)]
    found = cache.nearest(rows[150])
    assert found is not None
    assert found.trace_id == "t150"


def test_a_ring_that_wraps_is_not_prefaulted() -> None:
    cache = VectorCache(capacity=64, dimensions=8)
    rows = np.stack([unit(i, 8) for i in range(100)])
    cache.extend(rows, np.arange(100, dtype=np.float64), [f"t{i}" for i in range(100)])
    assert not cache.prefault()
    assert np.array_equal(entries(cache).vectors, rows[36:])
