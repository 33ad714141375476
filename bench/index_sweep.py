"""Could an inverted file meet the memory's 1 ms p99 at a million where the graph does not?

    python -m bench.index_sweep [--size 1000000] [--cells 4096] [--pq 96]
        [--probes 64,256,384,512] [--rescore 64,512] [--queries 500]

The memory phase's vectors and queries (bench.memory: real MiniLM vectors, derived ones past
100,000; near-duplicates and fresh paragraphs), one core. A faiss inverted file with 4-bit
fast-scan product-quantised codes (`IndexIVFPQFastScan`, inner product on unit vectors) is
trained and filled; then:

1. coverage: for each query, the stored row with the exact maximum (float64), its cell, and
   how many cells (by the centroid's inner product with the query, the order faiss probes them
   in) and stored entries a search must visit to reach it. Any inverted file with these cells
   must visit that much, whatever its codes, to be able to return the exact maximum.
2. the index as the cache would use it: `nprobe` cells searched, the best `k` candidates
   rescored exactly in float64, against the exact maximum: how often equal (near-duplicates
   with a maximum >= 0.9, fresh, all), the worst difference, p50/p99 a query.

Prints both tables and writes bench/results/index_sweep.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import numpy.typing as npt

from bench import memory
from bench.stats import percentile

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "index_sweep.json"
_PERCENTS = (50, 90, 95, 98, 99, 100)


def _unit(x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    return np.ascontiguousarray(x / np.linalg.norm(x, axis=1, keepdims=True), dtype=np.float32)


def build(stored: npt.NDArray[np.float32], cells: int, pq: int) -> tuple[Any, float]:
    index = faiss.IndexIVFPQFastScan(
        faiss.IndexFlatIP(stored.shape[1]),
        stored.shape[1],
        cells,
        pq,
        4,
        faiss.METRIC_INNER_PRODUCT,
    )
    started = time.perf_counter()
    sample = np.random.default_rng(1).choice(
        len(stored), min(len(stored), cells * 40), replace=False
    )
    index.train(stored[np.sort(sample)])
    index.add(stored)
    return index, time.perf_counter() - started


def coverage(
    index: Any,
    stored: npt.NDArray[np.float32],
    queries: npt.NDArray[np.float32],
    rows: npt.NDArray[np.int64],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Per query: the cells and the entries probed up to and including the exact maximum's."""
    _, cell_of = index.quantizer.search(stored, 1)
    sizes = np.bincount(cell_of[:, 0], minlength=index.nlist)
    _, order = index.quantizer.search(queries, index.nlist)
    rank = np.array(
        [int(np.nonzero(order[i] == cell_of[rows[i], 0])[0][0]) for i in range(len(queries))]
    )
    visited = np.array([int(sizes[order[i, : rank[i] + 1]].sum()) for i in range(len(queries))])
    return rank + 1, visited


def run(args: argparse.Namespace) -> dict[str, Any]:
    faiss.omp_set_num_threads(1)
    vectors, near, fresh = memory.corpus_and_queries(args.queries)
    stored = _unit(memory.memory_of(vectors, args.size))
    groups = {"near_duplicates": _unit(near), "fresh": _unit(fresh)}
    truth = {name: memory.exact_best(stored, q) for name, q in groups.items()}
    # Who counts: near-duplicates whose exact maximum is >= 0.9 (as bench.memory), every fresh one.
    counted = {
        name: truth[name][0] >= 0.9 if name == "near_duplicates" else np.ones(len(q), bool)
        for name, q in groups.items()
    }
    index, build_s = build(stored, args.cells, args.pq)
    doc: dict[str, Any] = {
        "entries": len(stored),
        "index": f"IVF{args.cells},PQ{args.pq}x4fs (inner product), one core",
        "build_s": round(build_s, 1),
        "code_bytes": int(index.code_size),
        "coverage": {},
        "searches": [],
    }
    for name, q in groups.items():
        best, rows = truth[name]
        mask = counted[name]
        cells, visited = coverage(index, stored, q, rows)
        doc["coverage"][name] = {
            "queries": int(mask.sum()),
            "exact_max_median": float(np.median(best[mask])),
            "percent": {
                str(p): {
                    "cells": int(np.percentile(cells[mask], p)),
                    "entries": int(np.percentile(visited[mask], p)),
                }
                for p in _PERCENTS
            },
        }
    for k in args.rescore:
        for nprobe in args.probes:
            params = faiss.SearchParametersIVF()
            params.nprobe = nprobe
            times: list[float] = []
            row: dict[str, Any] = {"nprobe": nprobe, "rescored": k}
            equal_all: list[bool] = []
            worst = 0.0
            for name, q in groups.items():
                best, _ = truth[name]
                got = np.empty(len(q))
                for i in range(len(q)):
                    started = time.perf_counter()
                    _, ids = index.search(q[i : i + 1], k, params=params)
                    # Rescored exactly as the truth was computed.
                    found = ids[0][ids[0] >= 0]
                    got[i] = memory.exact_best(stored[found], q[i : i + 1])[0][0]
                    times.append((time.perf_counter() - started) * 1000)
                equal = np.abs(best - got) <= 1e-9
                row[name] = float(equal[counted[name]].mean())
                equal_all += list(equal)
                worst = max(worst, float((best - got).max()))
            row |= {
                "all": float(np.mean(equal_all)),
                "worst_difference": worst,
                "p50_ms": percentile(times, 50),
                "p99_ms": percentile(times, 99),
            }
            doc["searches"].append(row)
            print(render_search(row), flush=True)
    return doc


def render_search(r: dict[str, Any]) -> str:
    return (
        f"nprobe {r['nprobe']:>4}, {r['rescored']:>4} rescored | {r['near_duplicates']:.4f}   |"
        f" {r['fresh']:.4f} | {r['all']:.4f} | {r['worst_difference']:.4f} |"
        f" {r['p50_ms']:.2f} / {r['p99_ms']:.2f}"
    )


def render(doc: dict[str, Any]) -> str:
    lines = [
        f"{doc['index']} over {doc['entries']} entries ({doc['code_bytes']} B of code an entry), "
        f"trained and filled in {doc['build_s']} s",
        "to hold the exact maximum, a search must probe (cells / entries, of the queries' share):",
    ]
    for name, c in doc["coverage"].items():
        parts = ", ".join(f"{p}%: {v['cells']} / {v['entries']}" for p, v in c["percent"].items())
        lines.append(
            f"  {name} (n={c['queries']}, median max {c['exact_max_median']:.3f}): {parts}"
        )
    lines.append("search                  | near-dup | fresh  | all    | worst  | p50/p99 ms")
    lines += [render_search(r) for r in doc["searches"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.index_sweep", description=__doc__.splitlines()[0]
    )

    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--cells", type=int, default=4096)
    parser.add_argument("--pq", type=int, default=96, help="sub-quantizers (4 bits each)")
    parser.add_argument("--probes", type=ints, default=[64, 256, 384, 512])
    parser.add_argument("--rescore", type=ints, default=[64, 512])
    parser.add_argument("--queries", type=int, default=500)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    doc = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(render(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
