"""The memory benches' own arithmetic: the exact maximum they compare against, the inverted
file's coverage, and bench.index_sweep's counting, optional libraries and results file."""

from __future__ import annotations

import argparse
import sys

import numpy as np
import pytest

from bench import index_sweep, memory


def _unit_rows(n: int, seed: int, dims: int = 384) -> np.ndarray:
    rows = np.random.default_rng(seed).standard_normal((n, dims)).astype(np.float32)
    unit: np.ndarray = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    return unit


def test_exact_best_is_the_maximum_cosine_and_its_row_across_blocks() -> None:
    stored = _unit_rows(250_000, 1, dims=16)  # more than one 100,000-row block
    queries = _unit_rows(7, 2, dims=16)
    queries[3] = stored[123_456]  # a stored vector: its own row, cosine 1
    best, rows = memory.exact_best(stored, queries)
    scores = stored.astype(np.float64) @ queries.astype(np.float64).T
    assert np.array_equal(rows, scores.argmax(axis=0))
    assert np.allclose(best, scores.max(axis=0), atol=1e-12)
    assert rows[3] == 123_456
    assert abs(best[3] - 1.0) < 1e-12
    assert np.array_equal(memory.exact_max(stored, queries), best)


def test_a_stored_vector_is_reached_in_its_own_cell_first() -> None:
    stored = _unit_rows(4_000, 3)
    index, _ = index_sweep.build(stored, cells=16, pq=48)
    picks = np.array([5, 700, 3_999])
    cells, visited = index_sweep.coverage(index, stored, stored[picks], picks)
    _, cell_of = index.quantizer.search(stored, 1)
    sizes = np.bincount(cell_of[:, 0], minlength=16)
    assert list(cells) == [1, 1, 1]
    assert list(visited) == [int(sizes[cell_of[i, 0]]) for i in picks]


def _setup(stored: np.ndarray, near: np.ndarray, fresh: np.ndarray) -> index_sweep.Setup:
    groups = {"near_duplicates": near, "fresh": fresh}
    truth = {name: memory.exact_best(stored, q) for name, q in groups.items()}
    counted = {name: np.ones(len(q), bool) for name, q in groups.items()}
    return index_sweep.Setup(stored, groups, truth, counted)


def test_measure_counts_a_candidate_list_that_misses_the_maximum() -> None:
    stored = _unit_rows(2_000, 4)
    setup = _setup(stored, stored[:5] + 0.01, _unit_rows(5, 5))

    def exact(q: np.ndarray) -> np.ndarray:
        top: np.ndarray = np.argsort(-(stored @ q[0]))[:4].astype(np.int64)
        return top

    def second_best(q: np.ndarray) -> np.ndarray:
        return exact(q)[1:]

    right = index_sweep.measure(setup, exact)
    assert (right["near_duplicates"], right["fresh"], right["all"]) == (1.0, 1.0, 1.0)
    assert abs(right["worst_difference"]) <= 1e-12
    wrong = index_sweep.measure(setup, second_best)
    assert wrong["all"] == 0.0
    assert wrong["worst_difference"] > 0.0


def test_a_library_that_is_not_installed_is_skipped_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # None in sys.modules makes the import fail, whether or not the library is installed.
    monkeypatch.setitem(sys.modules, "scann", None)
    monkeypatch.setitem(sys.modules, "usearch", None)
    monkeypatch.setitem(sys.modules, "faiss", None)
    stored = _unit_rows(50, 6)
    setup = _setup(stored, stored[:2], stored[2:4])
    args = argparse.Namespace(adds=0)
    for lib in index_sweep.LIBRARIES:
        section = index_sweep.library_phase(lib, setup, args)
        assert list(section) == ["skipped"]
        assert "not installed" in section["skipped"]


def test_the_flat_product_quantiser_finds_every_maximum_when_it_rescores_every_entry() -> None:
    stored = _unit_rows(2_000, 7)
    setup = _setup(stored, stored[:20] + 0.01 * _unit_rows(20, 8), _unit_rows(20, 9))
    args = argparse.Namespace(adds=100, flatpq_m=[16], flatpq_rescore=[8, 2_000])
    (config,) = index_sweep.library_phase("flatpq", setup, args)["configs"]
    assert config["bytes_per_entry"] == 8.0  # 16 codes of 4 bits
    assert config["adds_timed"] == 100
    _, every = config["searches"]
    assert (every["rescored"], every["all"]) == (2_000, 1.0)
    assert abs(every["worst_difference"]) <= 1e-12


def test_a_library_run_keeps_the_other_sections_of_the_results() -> None:
    previous = {"entries": 1_000_000, "searches": [1], "usearch": {"configs": [2]}}
    assert index_sweep.merged(previous, {"scann": {"configs": [3]}}, ["scann"]) == {
        "entries": 1_000_000,
        "searches": [1],
        "usearch": {"configs": [2]},
        "scann": {"configs": [3]},
    }
    # A faiss run replaces the top level and keeps the libraries' sections.
    assert index_sweep.merged(previous, {"entries": 100_000}, ["faiss"]) == {
        "entries": 100_000,
        "usearch": {"configs": [2]},
    }


def test_a_library_run_at_the_same_size_replaces_only_its_own_configurations() -> None:
    previous = {"scann": {"entries": 10, "configs": [{"index": "a", "x": 1}, {"index": "b"}]}}
    run = {"scann": {"entries": 10, "configs": [{"index": "a", "x": 2}]}}
    assert index_sweep.merged(previous, run, ["scann"])["scann"]["configs"] == [
        {"index": "b"},
        {"index": "a", "x": 2},
    ]
    # At another size, nothing of the earlier section is kept.
    other = {"scann": {"entries": 20, "configs": [{"index": "c"}]}}
    assert index_sweep.merged(previous, other, ["scann"]) == other
