"""The exact confirmation of a near-duplicate, pruned by cosine bounds (app.store.cosine_bounds,
docs/operating/large-memory.md): the same answer as the full scan (the same maximum, the same
entry, ties to the newest), whatever the entries, the bounds' coverage or the evictions, while
it reads a fraction of the memory."""

from __future__ import annotations

import time

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.domain.vector_cache import VectorCache, exact_cosine
from app.store.cosine_bounds import CosineBounds, fit_basis
from app.store.indexed_memory import BOUND_BATCH, IndexedCache
from tests.test_large_memory import DIMS, clustered, edit


@st.composite
def memories(draw: st.DrawFn) -> dict[str, object]:
    dims = draw(st.integers(2, 8))
    count = draw(st.integers(1, 260))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    # Few directions (as text embeddings: near a low-rank space), repeats (the same text
    # stored again: ties), zero rows, and lengths far from 1.
    centres = rng.standard_normal((draw(st.integers(1, 4)), dims))
    rows = centres[rng.integers(0, len(centres), count)] + draw(
        st.sampled_from([0.0, 0.05, 0.5])
    ) * rng.standard_normal((count, dims))
    for i in range(count):
        kind = rng.integers(0, 10)
        if kind == 0 and i:
            rows[i] = rows[rng.integers(0, i)]
        elif kind == 1:
            rows[i] = 0.0
        elif kind == 2:
            rows[i] *= 10.0 ** rng.integers(-12, 12)
    tier2 = draw(st.integers(1, dims))
    return {
        "dims": dims,
        "rows": rows.astype(np.float32),
        "capacity": draw(st.integers(1, count + 5)),
        "threshold": draw(st.integers(1, max(1, count))),
        "tiers": (draw(st.integers(1, tier2)), tier2),
        "query_seed": seed + 1,
        "skip": draw(st.integers(0, 3)),
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(memories())
def test_the_pruned_scan_answers_as_the_full_scan(m: dict[str, object]) -> None:
    """Against the plain exact scan: the same cosine, trace and time for queries near stored
    entries, stored entries themselves and random ones, from any true cosine as the known
    one, with entries older and newer than the bounds (the newest are always scanned)."""
    dims, rows = int(m["dims"]), np.asarray(m["rows"])  # type: ignore[call-overload]
    capacity = int(m["capacity"])  # type: ignore[call-overload]
    pruned = IndexedCache(
        capacity=capacity,
        dimensions=dims,
        index_threshold=int(m["threshold"]),  # type: ignore[call-overload]
        background=False,
        bound_tiers=m["tiers"],  # type: ignore[arg-type]
    )
    pruned.hold_index(True)  # no graph: the bounds alone are under test
    plain = VectorCache(capacity=capacity, dimensions=dims)
    for i, row in enumerate(rows):
        for cache in (pruned, plain):
            cache.add(row, added_at_ms=float(i), trace_id=f"t{i}")
    rng = np.random.default_rng(int(m["query_seed"]))  # type: ignore[call-overload]
    first, stop = plain.sequence_range
    skip = min(int(m["skip"]), stop - first - 1)  # type: ignore[call-overload]
    live = plain.entries()
    for _ in range(6):
        pick = live.vectors[rng.integers(0, len(live.vectors))]
        query = rng.choice(
            [pick, pick + 0.01 * rng.standard_normal(dims), rng.standard_normal(dims)]
        ).astype(np.float32)
        truth = plain.nearest(query, skip)
        assert truth is not None
        # A true cosine of a searched entry: the maximum itself, or any other.
        other = live.vectors[skip + rng.integers(0, len(live.vectors) - skip)]
        for lower in (truth.cosine, exact_cosine(query, other)):
            found = pruned.nearest_from(query, lower, skip)
            assert found is not None
            assert (found.cosine, found.trace_id, found.added_at_ms) == (
                truth.cosine,
                truth.trace_id,
                truth.added_at_ms,
            )


def test_bounds_cover_the_memory_but_its_newest_batch() -> None:
    stored = clustered(3_000, seed=71)
    cache = IndexedCache(capacity=2_000, index_threshold=1_000, background=False)
    for i, v in enumerate(stored[:999]):
        cache.add(v, trace_id=f"t{i}")
    assert cache.bounded_range() is None  # below the threshold: no index, no bounds
    for i, v in enumerate(stored[999:], start=999):
        cache.add(v, trace_id=f"t{i}")
    first, stop = cache.sequence_range
    bounded = cache.bounded_range()
    assert bounded is not None
    assert bounded[0] <= first  # the evicted entries' segment may stay until it is all gone
    assert stop - BOUND_BATCH < bounded[1] <= stop
    cache.clear()
    assert cache.bounded_range() is None


def test_the_status_says_what_the_bounds_cover_and_when_the_full_scan_confirmed() -> None:
    """Operators see the bounds (/readyz, metrics): none and a full-scan confirmation before
    the threshold; past it, the memory but its newest batch covered, and no full scan."""
    stored = clustered(3_000, seed=78)
    cache = IndexedCache(capacity=2_000, index_threshold=1_000, background=False)
    for i, v in enumerate(stored[:999]):
        cache.add(v, trace_id=f"t{i}")
    status = cache.index_status()
    assert (status.bounded, status.bound_fits_total, status.full_scan_confirmations_total) == (
        0,
        0,
        0,
    )
    assert cache.nearest_from(stored[5], 0.5) is not None
    assert cache.index_status().full_scan_confirmations_total == 1
    for i, v in enumerate(stored[999:], start=999):
        cache.add(v, trace_id=f"t{i}")
    status = cache.index_status()
    assert cache.size - BOUND_BATCH < status.bounded <= cache.size
    assert status.bound_fits_total >= 1
    assert cache.nearest_from(stored[2_500], 0.5) is not None
    assert cache.index_status().full_scan_confirmations_total == 1
    cache.clear()
    assert cache.index_status().bounded == 0


def test_a_near_duplicate_is_confirmed_from_a_fraction_of_the_memory() -> None:
    """Planted near-duplicates among many distractors of a few topics (as text embeddings
    are): every one found exactly and named, reading under a tenth of the entries."""
    rng = np.random.default_rng(72)
    centres = rng.standard_normal((12, DIMS))
    rows = centres[rng.integers(0, 12, 20_000)] + 0.8 * rng.standard_normal((20_000, DIMS))
    stored = (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)
    norms = np.linalg.norm(stored.astype(np.float64), axis=1)
    bounds = CosineBounds(fit_basis(stored[:5_000].astype(np.float64) / norms[:5_000, None], 64), 0)
    bounds.extend(stored, norms)
    exact = VectorCache(capacity=20_000)
    for i, v in enumerate(stored):
        exact.add(v, trace_id=f"t{i}")
    for i in rng.choice(len(stored), 30, replace=False):
        query = edit(stored[i], rng, 0.3)
        truth = exact.nearest(query)
        assert truth is not None
        assert truth.cosine >= 0.9
        q = query.astype(np.float64) / np.linalg.norm(query.astype(np.float64))
        seqs = bounds.candidates(q, 0, len(stored), truth.cosine)
        assert int(truth.trace_id[1:]) in seqs
        assert len(seqs) < len(stored) / 10


def test_the_background_bounds_catch_up_and_answer_exactly() -> None:
    stored = clustered(6_000, seed=73)
    cache = IndexedCache(capacity=5_000, index_threshold=2_000)
    exact = VectorCache(capacity=5_000)
    for i, v in enumerate(stored):
        cache.add(v, trace_id=f"t{i}")
        exact.add(v, trace_id=f"t{i}")
    deadline = time.monotonic() + 60
    while True:
        bounded = cache.bounded_range()
        if bounded is not None and bounded[1] > cache.sequence_range[1] - BOUND_BATCH:
            break
        assert time.monotonic() < deadline, bounded
        time.sleep(0.05)
    rng = np.random.default_rng(74)
    for i in rng.choice(5_000, 20, replace=False):
        query = edit(stored[1_000 + i], rng, 0.3)
        truth = exact.nearest(query)
        assert truth is not None
        found = cache.nearest(query)
        assert found is not None
        assert (found.cosine, found.trace_id, found.search) == (
            truth.cosine,
            truth.trace_id,
            "exact",
        )
    cache.wait_for_index(60)


def test_the_bounds_are_fitted_again_when_the_memory_has_moved_on() -> None:
    """A memory that turns over to other topics gets a basis fitted on what it now holds
    (the old one would give true but loose bounds), and its answers stay the full scan's."""
    before = clustered(1_500, seed=75, clusters=8)
    after = clustered(1_500, seed=76, clusters=8)
    cache = IndexedCache(capacity=1_000, index_threshold=500, background=False)
    cache.hold_index(True)  # the bounds alone are under test
    exact = VectorCache(capacity=1_000)
    for i, v in enumerate(np.concatenate([before, after])):
        cache.add(v, trace_id=f"t{i}")
        exact.add(v, trace_id=f"t{i}")
    # Fitted at 500 entries, again once those had all left (twice over 3,000 adds).
    assert cache.bound_fits_total >= 3
    rng = np.random.default_rng(77)
    for i in rng.choice(1_000, 20, replace=False):
        query = edit(after[500 + i], rng, 0.3)
        truth = exact.nearest(query)
        assert truth is not None
        found = cache.nearest_from(query, truth.cosine)
        assert found is not None
        assert (found.cosine, found.trace_id) == (truth.cosine, truth.trace_id)
