"""The far search's breadth (KP_CACHE_INDEX_EF_SEARCH_FAR) at one memory size: what each
choice gives fresh traces (within 0.02 of the exact maximum, the worst difference, query time
on one core) and what it costs a dry-run typical request against a 1,000-entry service.

    python -m bench.far_sweep [--size 100000] [--values 0,256,512,1024]

The memory, the queries and the services are bench.memory's: the memory is loaded and its
graph built once; each breadth is set on that graph for the in-process queries, then a
service restarted on its snapshot and graph with the breadth set takes the dry-run turns
against the 1,000-entry one, every breadth twice (in order, then in reverse: drift evens out).
Writes bench/results/far_sweep.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import faiss
import httpx
import numpy as np

from app.domain.vector_cache import CacheEntries
from app.store.indexed_memory import IndexedCache
from bench.memory import (
    corpus_and_queries,
    cpu_name,
    dry_run_turns,
    exact_max,
    memory_of,
)
from bench.stats import percentile

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "far_sweep.json"


def in_process(cache: IndexedCache, fresh: Any, truth: Any, value: int) -> dict[str, Any]:
    cache.set_far_breadth(value)
    answers, times_ms = [], []
    for q in fresh:
        t = time.perf_counter()
        found = cache.nearest(q)
        times_ms.append((time.perf_counter() - t) * 1000)
        assert found is not None
        answers.append(found.cosine)
    diff = truth - np.asarray(answers)
    return {
        "within_0_02": float((diff <= 0.02).mean()),
        "worst_difference": float(diff.max()),
        "exact": float((diff <= 1e-9).mean()),
        "query_p50_ms": percentile(times_ms, 50),
        "query_p99_ms": percentile(times_ms, 99),
    }


def run(size: int, values: list[int], queries: int, threshold: int) -> dict[str, Any]:
    from app.embedding import model_files
    from app.services.snapshots import SnapshotStore, write_graph, write_snapshot
    from bench.server import Server

    vectors, _, fresh = corpus_and_queries(queries)
    stored = memory_of(vectors, size)
    cache = IndexedCache(capacity=size, index_threshold=threshold)
    now = time.time() * 1000
    times = (now - 1000.0 + np.arange(size) * (1000.0 / size)).astype(np.float64)
    cache.load(CacheEntries(stored, times, [f"kp:trace:{i}" for i in range(size)]))
    while not cache.wait_for_index(600) or cache.index_status().state != "ready":
        time.sleep(0.1)
    faiss.omp_set_num_threads(1)  # queries on one core
    truth = exact_max(stored, fresh)
    doc: dict[str, Any] = {"cpu": cpu_name(), "entries": size, "fresh": len(fresh), "runs": []}
    per_value = {v: in_process(cache, fresh, truth, v) for v in values}
    files = model_files.resolve(None, None)
    model_id = model_files.identity(files, "float32")
    common = {
        "KP_EMBEDDER_PRELOAD": "true",
        "KP_EMBEDDER_WORKERS": "1",
        "KP_LOG_LEVEL": "warning",
        "KP_CACHE_SNAPSHOT_INTERVAL_S": "100000",
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        big, small = work / "big.snapshot", work / "small.snapshot"
        assert SnapshotStore(big, cache, model_id).save(force=True)
        graph = cache.serving_graph()
        assert graph is not None
        write_graph(big, graph, model_id, cache.dimensions)
        del graph, cache
        ids = [f"kp:trace:{i}" for i in range(1000)]
        stamps = (now - 1000.0 + np.arange(1000) * 1.0).astype(np.float64)
        write_snapshot(small, CacheEntries(stored[-1000:], stamps, ids), model_id)
        for value in [*values, *reversed(values)]:
            # Both started afresh for every run: a service remembers the embeddings of the
            # traces it has seen (the same 200 each run).
            smaller = Server(
                common | {"KP_CACHE_CAPACITY": "1000", "KP_CACHE_SNAPSHOT_PATH": str(small)},
                work / "small.log",
            )
            large = Server(
                common
                | {
                    "KP_CACHE_CAPACITY": str(size),
                    "KP_CACHE_SNAPSHOT_PATH": str(big),
                    "KP_CACHE_INDEX_EF_SEARCH_FAR": str(value),
                },
                work / "large.log",
                timeout_s=600,
            )
            try:
                base = f"http://127.0.0.1:{large.port}"
                with httpx.Client(base_url=base, timeout=60) as cl:
                    while cl.get("/readyz").json()["status"] != "ready":
                        time.sleep(0.2)
                    with httpx.Client(
                        base_url=f"http://127.0.0.1:{smaller.port}", timeout=60
                    ) as cs:
                        turns = dry_run_turns(cl, cs)
            finally:
                large.stop()
                smaller.stop()
            doc["runs"].append({"ef_search_far": value} | turns)
            print(value, f"ratio {turns['request_ratio']:.3f}", flush=True)
    doc["values"] = [
        {
            "ef_search_far": v,
            **per_value[v],
            "request_ratios": [r["request_ratio"] for r in doc["runs"] if r["ef_search_far"] == v],
        }
        for v in values
    ]
    return doc


def render(doc: dict[str, Any]) -> str:
    lines = [
        f"far search breadth at {doc['entries']} entries, {doc['fresh']} fresh traces, "
        f"{doc['cpu']}",
        "efSearch far | within 0.02 | worst  | exact  | query p50/p99 ms | dry-run ratio (runs)",
    ]
    for v in doc["values"]:
        ratios = v["request_ratios"]
        lines.append(
            f"{v['ef_search_far']:>12} | {v['within_0_02']:.4f}      | {v['worst_difference']:.4f} "
            f"| {v['exact']:.4f} | {v['query_p50_ms']:.2f} / {v['query_p99_ms']:.2f}"
            f"      | {np.mean(ratios):.3f} ({', '.join(f'{r:.3f}' for r in ratios)})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.far_sweep", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--size", type=int, default=100_000)
    parser.add_argument("--values", default="0,256,512,1024")
    parser.add_argument("--queries", type=int, default=500)
    parser.add_argument("--threshold", type=int, default=20_000)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    values = [int(v) for v in args.values.split(",")]
    doc = run(args.size, values, args.queries, args.threshold)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(render(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
