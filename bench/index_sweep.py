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

With `--libs`, the same queries, truth and counting for other libraries (each optional: one
not installed is skipped with the reason printed), candidates rescored exactly as above:
- `scann`: ScaNN's tree (`--scann-leaves`; SOAR spilling with `--scann-soar` lambdas, 0 for
  none) with anisotropic 4-bit codes (`--scann-dims-per-block`, threshold 0.2) and its own float32
  reordering of `--scann-reorder` candidates, searched over `--scann-search` leaves;
- `usearch`: usearch's HNSW (`--usearch-connectivity`, `--usearch-dtype`, expansion_add
  `--usearch-expansion-add`) at expansion_search `--usearch-expansion` x `--usearch-rescore`
  candidates;
- `flatpq`: no partition at all, faiss's 4-bit fast-scan product quantiser over every entry
  (`IndexPQFastScan`, `--flatpq-m` sub-quantizers), its best `--flatpq-rescore` candidates
  rescored: what a full scan of compact codes gives where the partitions miss.
All three also report the build (on all cores for ScaNN and usearch), bytes an entry and the add
rate of single adds on one core (the last `--adds` entries go in one at a time after the build).

Prints the tables and writes bench/results/index_sweep.json (a run's sections replace the same
sections of the file and keep the others: `--libs scann` leaves the faiss figures as they were).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import numpy.typing as npt

from bench import memory
from bench.stats import percentile

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "index_sweep.json"
_PERCENTS = (50, 90, 95, 98, 99, 100)
LIBS = ("faiss", "scann", "usearch", "flatpq")
_MEASURED = {"near_duplicates", "fresh", "all", "worst_difference", "p50_ms", "p99_ms"}
#: ScaNN has already scored its reordered candidates exactly (float32); rescoring its best few
#: in float64 only settles float32 ties, as the truth is float64.
SCANN_FINAL = 16

Search = Callable[[npt.NDArray[np.float32]], npt.NDArray[np.int64]]


@dataclass(frozen=True)
class Setup:
    """The stored vectors, the query groups, their exact maxima and which queries count."""

    stored: npt.NDArray[np.float32]
    groups: dict[str, npt.NDArray[np.float32]]
    truth: dict[str, tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]]
    counted: dict[str, npt.NDArray[np.bool_]]


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


def measure(setup: Setup, search: Search) -> dict[str, Any]:
    """Each query on its own (as the service asks), its candidates rescored exactly as the truth
    was computed: how often the exact maximum (per group, counted queries; all queries), the
    worst difference, p50/p99 of search and rescoring."""
    times: list[float] = []
    row: dict[str, Any] = {}
    equal_all: list[bool] = []
    worst = 0.0
    for name, q in setup.groups.items():
        best, _ = setup.truth[name]
        got = np.empty(len(q))
        for i in range(len(q)):
            started = time.perf_counter()
            ids = search(q[i : i + 1])
            found = ids[ids >= 0]
            got[i] = memory.exact_best(setup.stored[found], q[i : i + 1])[0][0]
            times.append((time.perf_counter() - started) * 1000)
        equal = np.abs(best - got) <= 1e-9
        row[name] = float(equal[setup.counted[name]].mean())
        equal_all += list(equal)
        worst = max(worst, float((best - got).max()))
    return row | {
        "all": float(np.mean(equal_all)),
        "worst_difference": worst,
        "p50_ms": percentile(times, 50),
        "p99_ms": percentile(times, 99),
    }


def setup_of(size: int, queries: int) -> Setup:
    vectors, near, fresh = memory.corpus_and_queries(queries)
    stored = _unit(memory.memory_of(vectors, size))
    groups = {"near_duplicates": _unit(near), "fresh": _unit(fresh)}
    truth = {name: memory.exact_best(stored, q) for name, q in groups.items()}
    # Who counts: near-duplicates whose exact maximum is >= 0.9 (as bench.memory), every fresh one.
    counted = {
        name: truth[name][0] >= 0.9 if name == "near_duplicates" else np.ones(len(q), bool)
        for name, q in groups.items()
    }
    return Setup(stored, groups, truth, counted)


def faiss_phase(setup: Setup, args: argparse.Namespace) -> dict[str, Any]:
    stored, groups, truth, counted = setup.stored, setup.groups, setup.truth, setup.counted
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

            def search(q: npt.NDArray[np.float32], k: int = k, params: Any = params) -> Any:
                return index.search(q, k, params=params)[1][0]

            row = {"nprobe": nprobe, "rescored": k} | measure(setup, search)
            doc["searches"].append(row)
            print(render_search(row), flush=True)
    return doc


def _optional(module: str) -> tuple[Any, str | None]:
    """The module, or None and why not (an optional library that is not installed)."""
    try:
        return importlib.import_module(module), None
    except ImportError as error:
        return None, f"{module.split('.')[0]} not installed here ({error})"


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def _built_at_once(n: int, args: argparse.Namespace) -> int:
    """Entries in the index's build; the last `--adds` are then added one call at a time."""
    return max(n - int(args.adds), 1)


def _timed_adds(add: Callable[[int], None], first: int, last: int) -> dict[str, Any]:
    """Rows first..last-1 added one call each (on one core): the add rate."""
    times: list[float] = []
    for i in range(first, last):
        started = time.perf_counter()
        add(i)
        times.append((time.perf_counter() - started) * 1000)
    if not times:
        return {}
    return {
        "adds_timed": len(times),
        "add_ms_mean": float(np.mean(times)),
        "add_ms_p99": percentile(times, 99),
        "adds_per_s": 1000 / float(np.mean(times)),
    }


def _searched(
    config: dict[str, Any], setup: Setup, searches: Iterable[tuple[dict[str, Any], Search]]
) -> dict[str, Any]:
    """A built configuration, printed, then each of its searches measured in turn (the
    search's settings beside its figures, printed as they come)."""
    print(render_config(config), flush=True)
    config["searches"] = []
    for settings, search in searches:
        row = settings | measure(setup, search)
        config["searches"].append(row)
        print(render_lib_search(row), flush=True)
    return config


def _scann_config(
    ops: Any, setup: Setup, args: argparse.Namespace, leaves: int, soar: float
) -> dict[str, Any]:
    stored, n = setup.stored, len(setup.stored)
    built = _built_at_once(n, args)
    started = time.perf_counter()
    builder = (
        ops.builder(stored[:built], SCANN_FINAL, "dot_product")
        .tree(
            num_leaves=leaves,
            num_leaves_to_search=min(args.scann_search),
            training_sample_size=min(built, 250_000),
            # SOAR: each entry also in a second leaf chosen to cover where its first misses.
            **({"soar_lambda": soar} if soar else {}),
        )
        .score_ah(args.scann_dims_per_block, anisotropic_quantization_threshold=0.2)
        .reorder(max(args.scann_reorder))
    )
    builder.set_n_training_threads(os.cpu_count() or 1)
    # Document ids make the searcher mutable (upsert), so the add rate can be measured.
    searcher = builder.build(docids=list(range(built)))
    spill = f", SOAR lambda {soar}" if soar else ""
    config: dict[str, Any] = {
        "index": f"ScaNN tree {leaves} leaves{spill}, AH {args.scann_dims_per_block} dims a "
        "block, threshold 0.2, reorder",
        "build_s": round(time.perf_counter() - started, 1),
    }
    config |= _timed_adds(lambda i: searcher.upsert([i], stored[i : i + 1]), built, n)
    with tempfile.TemporaryDirectory() as tmp:
        searcher.serialize(tmp)
        size = sum(f.stat().st_size for f in Path(tmp).iterdir())
    config["bytes_per_entry"] = size / n

    def searches() -> Iterator[tuple[dict[str, Any], Search]]:
        for reorder in args.scann_reorder:
            for leaves_searched in args.scann_search:

                def search(
                    q: npt.NDArray[np.float32], r: int = reorder, lv: int = leaves_searched
                ) -> Any:
                    ids, _ = searcher.search(q[0], SCANN_FINAL, r, lv)
                    return np.asarray(ids, dtype=np.int64)

                yield {"leaves_searched": leaves_searched, "reordered": reorder}, search

    return _searched(config, setup, searches())


def _usearch_config(
    module: Any, setup: Setup, args: argparse.Namespace, connectivity: int, dtype: str
) -> dict[str, Any]:
    stored, n = setup.stored, len(setup.stored)
    built = _built_at_once(n, args)
    index = module.Index(
        ndim=stored.shape[1],
        metric="cos",
        dtype=dtype,
        connectivity=connectivity,
        expansion_add=args.usearch_expansion_add,
    )
    started = time.perf_counter()
    index.add(np.arange(built), stored[:built], threads=os.cpu_count() or 1)
    config: dict[str, Any] = {
        "index": f"usearch HNSW connectivity {connectivity}, {dtype}, "
        f"expansion_add {args.usearch_expansion_add}",
        "build_s": round(time.perf_counter() - started, 1),
        "hardware": str(index.hardware_acceleration),
    }
    config |= _timed_adds(lambda i: index.add(i, stored[i], threads=1), built, n)
    config["bytes_per_entry"] = index.memory_usage / n

    def searches() -> Iterator[tuple[dict[str, Any], Search]]:
        for k in args.usearch_rescore:
            for expansion in args.usearch_expansion:
                index.expansion_search = expansion  # set as each search's turn comes

                def search(q: npt.NDArray[np.float32], k: int = k) -> Any:
                    return np.asarray(index.search(q[0], k, threads=1).keys, dtype=np.int64)

                yield {"expansion_search": expansion, "rescored": k}, search

    return _searched(config, setup, searches())


def _flatpq_config(module: Any, setup: Setup, args: argparse.Namespace, m: int) -> dict[str, Any]:
    stored, n = setup.stored, len(setup.stored)
    built = _built_at_once(n, args)
    index = module.IndexPQFastScan(stored.shape[1], m, 4, module.METRIC_INNER_PRODUCT)
    started = time.perf_counter()
    sample = np.random.default_rng(1).choice(built, min(built, 65_536), replace=False)
    index.train(stored[np.sort(sample)])
    index.add(stored[:built])
    config: dict[str, Any] = {
        "index": f"faiss PQ{m}x4fs over every entry (inner product)",
        "build_s": round(time.perf_counter() - started, 1),
    }
    config |= _timed_adds(lambda i: index.add(stored[i : i + 1]), built, n)
    config["bytes_per_entry"] = float(index.code_size)

    def search(q: npt.NDArray[np.float32], k: int) -> Any:
        return index.search(q, k)[1][0]

    return _searched(
        config, setup, (({"rescored": k}, partial(search, k=k)) for k in args.flatpq_rescore)
    )


#: The other libraries and indexes: the distribution (its version is reported), the module each
#: is used through, the grid of its configurations (from the command line) and how one of them
#: is built and measured.
LIBRARIES: dict[
    str, tuple[str, str, Callable[[argparse.Namespace], list[Any]], Callable[..., Any]]
] = {
    "scann": (
        "scann",
        "scann.scann_ops.py.scann_ops_pybind",
        lambda a: [(leaves, soar) for soar in a.scann_soar for leaves in a.scann_leaves],
        _scann_config,
    ),
    "usearch": (
        "usearch",
        "usearch.index",
        lambda a: [(c, dtype) for c in a.usearch_connectivity for dtype in a.usearch_dtype],
        _usearch_config,
    ),
    "flatpq": ("faiss-cpu", "faiss", lambda a: [(m,) for m in a.flatpq_m], _flatpq_config),
}


def library_phase(lib: str, setup: Setup, args: argparse.Namespace) -> dict[str, Any]:
    """A library's section: its configurations measured, or why it was skipped."""
    dist, module_name, grid, measured = LIBRARIES[lib]
    module, why = _optional(module_name)
    if module is None:
        return {"skipped": why}
    return {
        "version": _version(dist),
        "entries": len(setup.stored),
        "configs": [measured(module, setup, args, *point) for point in grid(args)],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    faiss.omp_set_num_threads(1)
    setup = setup_of(args.size, args.queries)
    doc: dict[str, Any] = {}
    if "faiss" in args.libs:
        doc |= faiss_phase(setup, args)
    for lib in LIBRARIES:
        if lib in args.libs:
            doc[lib] = library_phase(lib, setup, args)
            if "skipped" in doc[lib]:
                print(f"{lib} skipped: {doc[lib]['skipped']}", flush=True)
    return doc


def render_search(r: dict[str, Any]) -> str:
    return (
        f"nprobe {r['nprobe']:>4}, {r['rescored']:>4} rescored | {r['near_duplicates']:.4f}   |"
        f" {r['fresh']:.4f} | {r['all']:.4f} | {r['worst_difference']:.4f} |"
        f" {r['p50_ms']:.2f} / {r['p99_ms']:.2f}"
    )


def render_config(c: dict[str, Any]) -> str:
    adds = (
        f", {c['adds_per_s']:.0f} single adds/s on one core (p99 {c['add_ms_p99']:.2f} ms)"
        if "adds_per_s" in c
        else ""
    )
    return f"{c['index']}: built in {c['build_s']} s, {c['bytes_per_entry']:.0f} B an entry{adds}"


def render_lib_search(r: dict[str, Any]) -> str:
    knob = ", ".join(f"{k} {v}" for k, v in r.items() if k not in _MEASURED)
    return (
        f"{knob:<40} | {r['near_duplicates']:.4f}   | {r['fresh']:.4f} | {r['all']:.4f} |"
        f" {r['worst_difference']:.4f} | {r['p50_ms']:.2f} / {r['p99_ms']:.2f}"
    )


def render_faiss(doc: dict[str, Any]) -> list[str]:
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
    return lines


def render(doc: dict[str, Any]) -> str:
    lines = render_faiss(doc) if "searches" in doc else []
    for lib in LIBS[1:]:
        section = doc.get(lib)
        if section is None:
            continue
        if "skipped" in section:
            lines.append(f"{lib}: skipped ({section['skipped']})")
            continue
        lines.append(f"{lib} {section['version']} over {section['entries']} entries, one core")
        for config in section["configs"]:
            lines.append(render_config(config))
            lines.append(f"{'search':<40} | near-dup | fresh  | all    | worst  | p50/p99 ms")
            lines += [render_lib_search(r) for r in config["searches"]]
    return "\n".join(lines)


def merged(previous: dict[str, Any], doc: dict[str, Any], libs: list[str]) -> dict[str, Any]:
    """This run's sections replace the file's, the others stay: a library's run keeps faiss's
    figures (the file's top level) and the other library's section. Within a library's section
    at the same size, this run's configurations replace the same ones and the others stay, so
    configurations can be measured in separate runs."""
    kept = {
        k: v for k, v in previous.items() if k not in libs and (k in LIBS or "faiss" not in libs)
    }
    out = kept | doc
    for lib in set(libs) & set(doc) - {"faiss"}:
        before, now = previous.get(lib, {}), doc[lib]
        if "configs" in now and before.get("entries") == now.get("entries", -1):
            names = {c["index"] for c in now["configs"]}
            others = [c for c in before.get("configs", []) if c["index"] not in names]
            out[lib] = now | {"configs": others + now["configs"]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.index_sweep", description=__doc__.splitlines()[0]
    )

    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    def floats(text: str) -> list[float]:
        return [float(x) for x in text.split(",")]

    def names(text: str) -> list[str]:
        return text.split(",")

    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--cells", type=int, default=4096)
    parser.add_argument("--pq", type=int, default=96, help="sub-quantizers (4 bits each)")
    parser.add_argument("--probes", type=ints, default=[64, 256, 384, 512])
    parser.add_argument("--rescore", type=ints, default=[64, 512])
    parser.add_argument("--queries", type=int, default=500)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--libs", type=names, default=["faiss"], help=f"some of {LIBS}")
    parser.add_argument("--adds", type=int, default=10_000, help="added one at a time, timed")
    parser.add_argument("--scann-leaves", type=ints, default=[2000, 4000])
    parser.add_argument("--scann-dims-per-block", type=int, default=2, help="of a 4-bit code")
    parser.add_argument("--scann-search", type=ints, default=[100, 200, 400, 800])
    parser.add_argument("--scann-reorder", type=ints, default=[100, 300, 1000])
    parser.add_argument("--scann-soar", type=floats, default=[0.0], help="0: no spilling")
    parser.add_argument("--usearch-connectivity", type=ints, default=[32, 64])
    parser.add_argument("--usearch-dtype", type=names, default=["f32", "i8"])
    parser.add_argument("--usearch-expansion-add", type=int, default=128)
    parser.add_argument("--usearch-expansion", type=ints, default=[64, 256, 1024, 2048])
    parser.add_argument("--usearch-rescore", type=ints, default=[16, 128])
    parser.add_argument("--flatpq-m", type=ints, default=[32, 64], help="sub-quantizers")
    parser.add_argument("--flatpq-rescore", type=ints, default=[256, 1024, 4096])
    args = parser.parse_args(argv)
    unknown = set(args.libs) - set(LIBS)
    if unknown:
        parser.error(f"--libs: unknown {sorted(unknown)}; known: {', '.join(LIBS)}")
    doc = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    args.out.write_text(json.dumps(merged(previous, doc, args.libs), indent=2) + "\n")
    print(render(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
