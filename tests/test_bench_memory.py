"""The memory bench's own arithmetic: the exact maximum it compares against, ties to the
newest as the memory's."""

from __future__ import annotations

import numpy as np

from bench import memory


def _unit_rows(n: int, seed: int, dims: int = 384) -> np.ndarray:
    rows = np.random.default_rng(seed).standard_normal((n, dims)).astype(np.float32)
    unit: np.ndarray = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    return unit


def test_exact_best_is_the_maximum_cosine_and_its_row_across_blocks() -> None:
    stored = _unit_rows(250_000, 1, dims=16)  # more than one 100,000-row block
    queries = _unit_rows(7, 2, dims=16)
    queries[3] = stored[123_456]  # a stored vector: its own row, cosine 1
    stored[200_000] = stored[123_456]  # a later copy: the tie goes to it
    best, rows = memory.exact_best(stored, queries)
    scores = stored.astype(np.float64) @ queries.astype(np.float64).T
    newest = len(stored) - 1 - scores[::-1].argmax(axis=0)
    assert np.array_equal(rows, newest)
    assert np.allclose(best, scores.max(axis=0), atol=1e-12)
    assert rows[3] == 200_000
    assert abs(best[3] - 1.0) < 1e-12
    assert np.array_equal(memory.exact_max(stored, queries), best)
