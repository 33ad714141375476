"""The large memory's search, as the score needs it (docs/operating/large-memory.md): exact
where the score turns (near-duplicates), within a stated bound elsewhere, said in every answer;
one tie rule whichever path answers; the index follows the memory."""

from __future__ import annotations

import re

import numpy as np
import numpy.typing as npt
import pytest

from app.api.mcp_server import summary
from app.schemas.responses import EvaluationOut
from app.store.indexed_memory import CONFIRM_FROM, INDEX_BOUND, TAIL_BATCH, IndexedCache
from tests.test_large_memory import DIMS, clustered, edit


def lone(count: int, seed: int) -> npt.NDArray[np.float32]:
    """Random unit vectors: far from the clustered ones and from each other."""
    v = np.random.default_rng(seed).standard_normal((count, DIMS))
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


def test_ties_go_to_the_newest_whichever_path_answers() -> None:
    """The same vector stored many times (whitespace variants of one text embed alike) ties
    for every query: the exact scan names the newest copy, and so does the index, whose
    candidate list (16 long) cannot hold every copy."""
    planted = lone(4, seed=31)
    distractors = clustered(6_000, seed=32)
    indexed = IndexedCache(capacity=20_000, index_threshold=2_000, background=False)
    exact = IndexedCache(capacity=20_000, search="exact")
    rows: list[tuple[npt.NDArray[np.float32], str]] = []
    for round_ in range(30):  # 30 copies of each, spread among the distractors
        rows += [(d, f"d{round_}-{i}") for i, d in enumerate(distractors[round_ * 200 :][:200])]
        rows += [(p, f"p{k}-copy{round_}") for k, p in enumerate(planted)]
    rows += [(d, f"tail{i}") for i, d in enumerate(clustered(2 * TAIL_BATCH, seed=33))]
    for cache in (indexed, exact):
        for v, name in rows:
            cache.add(v, trace_id=name)
    assert indexed.index_status().indexed > len(rows) - TAIL_BATCH  # the copies are indexed
    rng = np.random.default_rng(34)
    for k, p in enumerate(planted):
        for query, path in ((p, "exact"), (edit(p, rng, 1.0), "index")):
            scans = indexed.index_status().confirmations_total
            found, truth = indexed.nearest(query), exact.nearest(query)
            assert found is not None
            assert truth is not None
            assert truth.trace_id == f"p{k}-copy29"
            assert (found.trace_id, found.cosine) == (truth.trace_id, truth.cosine)
            # The stored vector itself: exact by identity, no scan; its edit (a cosine of
            # about 0.7): the index answered.
            assert found.search == path
            assert indexed.index_status().confirmations_total == scans


def test_the_answer_says_how_it_was_found() -> None:
    """'exact' below the threshold, with KP_CACHE_SEARCH=exact, and for every index answer
    from CONFIRM_FROM up (rescanned exactly: a near-duplicate's answer is the exact one);
    'index' with its bound otherwise."""
    stored = clustered(6_000, seed=41)
    small = IndexedCache(capacity=10_000, index_threshold=5_000, background=False)
    forced = IndexedCache(capacity=10_000, search="exact", index_threshold=1_000)
    indexed = IndexedCache(capacity=10_000, index_threshold=2_000, background=False)
    for i, v in enumerate(stored):
        indexed.add(v, trace_id=f"t{i}")
        forced.add(v, trace_id=f"t{i}")
        if i < 4_000:
            small.add(v, trace_id=f"t{i}")
    rng = np.random.default_rng(42)
    fresh = lone(1, seed=43)[0]
    for cache in (small, forced):
        found = cache.nearest(fresh)
        assert found is not None
        assert (found.search, found.bound) == ("exact", None)
    found = indexed.nearest(fresh)
    assert found is not None
    assert (found.search, found.bound) == ("index", INDEX_BOUND)
    before = indexed.index_status().confirmations_total
    for i in rng.choice(len(stored), 20, replace=False):
        found = indexed.nearest(edit(stored[i], rng, 0.3))
        assert found is not None
        assert found.cosine >= CONFIRM_FROM
        assert (found.search, found.bound) == ("exact", None)
    assert indexed.index_status().confirmations_total == before + 20


def test_mcp_text_says_when_the_index_answered() -> None:
    scores = {"complexity": 0.5, "novelty": 0.4, "tool_diversity": 0.5, "outcome_confidence": 0.9}
    out = EvaluationOut.model_validate(
        {
            "trace_id": "kp:trace:a",
            "score": 0.8,
            "dimensions": scores,
            "weights": {"profile": "default"} | scores,
            "profile": {"name": "default", "domain_recognised": True},
            "overrides": [],
            "novelty": {
                "measured": True,
                "reason": None,
                "max_cosine": 0.6,
                "cache_size": 30_000,
                "tokens": 40,
                "truncated": False,
                "nearest": {"trace_id": "kp:trace:b", "cosine": 0.6, "age_ms": 5.0},
                "search": "index",
                "search_bound": INDEX_BOUND,
            },
            "elapsed_ms": 10.0,
        }
    )
    assert "within 0.05 of the exact maximum" in summary(out)
    exact = out.model_copy(
        update={"novelty": out.novelty.model_copy(update={"search": "exact", "search_bound": None})}
    )
    assert "approximate" not in summary(exact)


def test_the_index_is_trained_again_when_the_memory_outgrows_it() -> None:
    """RETRAIN_GROWTH: the graph is built again, its codes trained on every live entry, when
    the memory reaches four times what it was trained on."""
    stored = clustered(4_100, seed=81)
    cache = IndexedCache(capacity=10_000, index_threshold=1_000, background=False)
    for i, v in enumerate(stored[:1_000]):
        cache.add(v, trace_id=f"t{i}")
    first = cache.index_status()
    assert (first.state, first.builds_total, first.trained_on) == ("ready", 1, 1_000)
    for i, v in enumerate(stored[1_000:3_999], start=1_000):
        cache.add(v, trace_id=f"t{i}")
    assert (cache.index_status().builds_total, cache.index_status().trained_on) == (1, 1_000)
    cache.add(stored[3_999], trace_id="t3999")
    again = cache.index_status()
    assert (again.builds_total, again.trained_on) == (2, 4_000)


@pytest.mark.slow  # seconds of index work: make test runs it, make test-fast does not
def test_many_cycles_of_eviction_and_expiry_keep_recall_and_memory_flat() -> None:
    """Twenty times the capacity goes through a memory past its threshold, with a TTL that
    also takes entries: the graph never holds much more than the capacity, the memory's bytes
    stop growing, its codes stay trained on the live entries, and fresh traces get answers as
    close to the exact maximum at the end as after the first cycle."""
    capacity = 2_500
    clock = [0.0]
    ttl_ms = 2_400 * 1_000.0  # a little under a capacity of traces, one a second
    cache = IndexedCache(
        capacity=capacity,
        ttl_ms=ttl_ms,
        clock_ms=lambda: clock[0],
        index_threshold=1_000,
        background=False,
    )
    exact = IndexedCache(
        capacity=capacity, ttl_ms=ttl_ms, clock_ms=lambda: clock[0], search="exact"
    )
    queries = clustered(60, seed=90, topics=1)
    rng = np.random.default_rng(91)
    memory: list[int] = []
    agreements: list[float] = []
    worst = 0.0
    total = 0
    for cycle in range(20):
        for v in clustered(capacity, seed=200 + cycle, topics=1):
            clock[0] += 1_000.0
            for c in (cache, exact):
                c.add(v, trace_id=f"c{total}")
            total += 1
        status = cache.index_status()
        assert status.state == "ready"
        assert status.indexed + TAIL_BATCH >= cache.size
        assert cache._index is not None
        assert cache._index.count <= capacity * 1.5 + TAIL_BATCH
        assert status.trained_on * 4 > cache.size
        memory.append(cache.stats().memory_bytes)
        agree = 0
        for q in queries:
            found, truth = cache.nearest(q), exact.nearest(q)
            assert found is not None
            assert truth is not None
            assert found.cosine <= truth.cosine + 1e-12
            worst = max(worst, truth.cosine - found.cosine)
            agree += found.cosine == truth.cosine
        agreements.append(agree / len(queries))
        planted = int(rng.integers(0, cache.size))
        first, _ = cache.sequence_range
        entry = cache.entries_between(first + planted, first + planted + 1)
        found = cache.nearest(edit(entry.vectors[0], rng, 0.3))
        assert found is not None
        assert found.trace_id == entry.ids()[0]
    # Bounded, not growing: the bytes swing with the rebuild cycle (a graph holding up to half
    # as many evicted entries as live ones) and the late cycles' peak is the early ones'.
    assert max(memory[5:]) <= max(memory[1:5]) * 1.05
    assert min(agreements[-5:]) >= min(agreements[:5]) - 0.05
    assert worst <= INDEX_BOUND


def test_the_memory_bench_prints_each_target_with_pass_or_fail() -> None:
    """bench.memory's figures and checks, on a small synthetic memory: the index trained on
    every entry, near-duplicates exact and named, the targets printed with PASS or FAIL and
    the CPU."""
    from bench import memory as bench_memory

    stored = clustered(8_000, seed=101)
    rng = np.random.default_rng(102)
    near = np.stack([edit(stored[i], rng, 0.3) for i in rng.choice(len(stored), 30, False)])
    fresh = clustered(30, seed=103, topics=1)
    result, cache = bench_memory.measure_size(stored, near, fresh, threshold=2_000)
    assert result["trained_on"] == len(stored)
    assert result["near_duplicate_count"] == 30
    assert (result["near_duplicate_recall"], result["near_duplicate_nearest"]) == (1.0, 1.0)
    assert result["fresh"]["worst_difference"] <= INDEX_BOUND
    checks = bench_memory.checks(result)
    assert {c["figure"] for c in checks} >= {
        "near_duplicate_recall",
        "near_duplicate_nearest",
        "near_duplicate_query_p99_ms",
        "fresh_within_0_02",
        "fresh_worst_difference",
        "add_ms_mean",
    }
    doc = {
        "cpu": bench_memory.cpu_name(),
        "source": "synthetic",
        "real_vectors": 0,
        "threshold": 2_000,
        "sizes": [result],
        "checks": checks,
    }
    printed = bench_memory.render(doc)
    assert bench_memory.cpu_name() in printed
    assert re.search(r"^  PASS +8000 near_duplicate_recall ", printed, re.M)
    assert sum(line.lstrip().startswith(("PASS", "FAIL")) for line in printed.splitlines()) == 6
    del cache
