"""Percentiles and the median of repeated runs."""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linearly interpolated."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def latency_summary(ms: list[float]) -> dict[str, float]:
    """p50/p90/p99 (and mean, max, count) of latencies in milliseconds."""
    return {
        "n": len(ms),
        "mean_ms": statistics.fmean(ms),
        "p50_ms": percentile(ms, 50),
        "p90_ms": percentile(ms, 90),
        "p99_ms": percentile(ms, 99),
        "max_ms": max(ms),
    }


def median_of_runs(runs: list[Any]) -> Any:
    """The same structure as one run, each number the median over the runs.

    Numbers are combined leaf by leaf (each figure's own median, as `--repeat` promises);
    anything else (strings, booleans, lists) is taken from the first run.
    """
    first = runs[0]
    if isinstance(first, dict):
        return {k: median_of_runs([r[k] for r in runs if k in r]) for k in first}
    if isinstance(first, int | float) and not isinstance(first, bool):
        value = statistics.median(float(r) for r in runs)
        return int(value) if all(isinstance(r, int) for r in runs) else value
    return first
