"""The memory phase: the novelty memory at 100,000 real MiniLM vectors and at 1,000,000.

    python -m bench.memory [--sizes 100000,1000000] [--queries 2000] [--no-service]

Vectors (bench.memory_corpus): paragraphs of the docstrings and changelogs Debian's packages
ship, embedded once by the service's own model (float32) and cached in ~/.cache/kp-scoring.
The 100,000-entry memory holds 100,000 of them (when fewer are embedded yet, as many as there
are, and derived ones for the rest: the report says how many are real). The 1,000,000-entry
one holds those and derived ones: each mixes two random real vectors (weights 1 and 0.5) with
10 % Gaussian noise, renormalised, so it lies among the real ones rather than in empty space.

Queries, each against the memory's answer and the exact maximum (float64 over every entry):
- near-duplicates: edits of stored texts (about 15 % of their words dropped at random),
  embedded by the model; counted among near-duplicates when the exact maximum is >= 0.9;
- fresh: real paragraphs that are not stored.
QUERIES of each by default: enough to tell the 99.9% target for fresh traces (two misses
allowed) from 99.8% (500 could not: one miss is 99.8%).

The memory is loaded whole (as a restart without a saved graph is) and its graph built on
every entry, its codes trained on all of them; then the queries, each answer with how it was
found (`search`: exact, or index within its bound), then a burst of adds into the full memory
(each evicting the oldest; the add's time, index upkeep included, and the feeder's rate).

Figures: near-duplicates' exact maximum and nearest named right, fresh traces within 0.02 of
the exact maximum and the worst difference, query p50/p99 on one core per group, the add's
time, bytes per entry, resident memory, PASS/FAIL against the targets (TARGETS), the CPU
named. With the service part (default), a snapshot of the largest memory and its graph beside
it are written, a service is restarted on them (to /healthz, and to ready with the graph
adopted, nothing built), and the dry-run latency of typical traces is compared with a service
holding 1,000, in turns of 20 requests. With --replica, `python -m bench.replica` runs at the
largest size (a new replica joining a shared memory, Redis memory per entry) and its figures
join the checks.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import numpy.typing as npt

from app.domain.vector_cache import CacheEntries
from app.store.indexed_memory import BOUND_BATCH, CONFIRM_FROM, IndexedCache
from bench import memory_corpus
from bench.server import rss_mb
from bench.stats import percentile

Matrix = npt.NDArray[np.float32]
#: The targets (docs/operating/large-memory.md), at every size measured.
TARGETS = {
    "near_duplicate_recall": 1.0,  # every near-duplicate (exact >= 0.9): the exact maximum
    "near_duplicate_nearest": 1.0,  # ... and the stored entry that has it named
    "near_duplicate_query_p99_ms": 1.0,  # one core, if it can be had (else: what it costs)
    "fresh_within_0_02": 0.999,  # fresh traces within 0.02 of the exact maximum
    "fresh_worst_difference": 0.05,  # never more than this
    "add_ms_mean": 0.1,
    "request_ratio": 1.25,  # dry-run typical p50 against a 1,000-entry service's
    "restart_to_ready_s": 30.0,  # from a snapshot with its graph
    "replica_to_ready_s": 60.0,  # a new replica joining the shared memory
}
REAL_VECTORS = 100_000
#: Near-duplicate and fresh queries, each (module docstring).
QUERIES = 2_000


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {len(os.sched_getaffinity(0))} cores"
    return f"{os.cpu_count()} cores"


DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "memory.json"


def derived(real: Matrix, count: int, seed: int) -> Matrix:
    rng = np.random.default_rng(seed)
    out = np.empty((count, real.shape[1]), dtype=np.float32)
    for start in range(0, count, 50_000):
        n = min(50_000, count - start)
        a = real[rng.integers(0, len(real), n)]
        b = real[rng.integers(0, len(real), n)]
        noise = rng.standard_normal((n, real.shape[1])).astype(np.float32)
        v = a + 0.5 * b + 0.1 * noise / np.sqrt(real.shape[1])
        out[start : start + n] = v / np.linalg.norm(v, axis=1, keepdims=True)
    return out


def memory_of(real: Matrix, size: int) -> Matrix:
    """`size` stored vectors: the real ones, then derived ones past them (the same for a size
    in every run: the derivation is seeded with it)."""
    if size <= len(real):
        return real[:size]
    return np.concatenate([real, derived(real, size - len(real), seed=size)])


def edited(text: str, rng: random.Random) -> str:
    words = text.split()
    kept = [w for w in words if rng.random() > 0.15]
    return " ".join(kept or words[:1])


def embed(texts: list[str]) -> Matrix:
    from app.embedding import model_files
    from app.embedding.onnx_embedder import OnnxEmbedder

    files = model_files.resolve(None, None)
    embedder = OnnxEmbedder(files.model, files.tokenizer, intra_op_threads=1)
    return np.concatenate([embedder.embed(texts[i : i + 32]) for i in range(0, len(texts), 32)])


def exact_best(
    stored: Matrix, queries: Matrix
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """The exact maximum cosine of each query over every stored vector, in float64, and the
    row that has it."""
    best = np.full(len(queries), -1.0)
    where = np.zeros(len(queries), dtype=np.int64)
    q64 = queries.astype(np.float64)
    q64 /= np.linalg.norm(q64, axis=1, keepdims=True)
    for start in range(0, len(stored), 100_000):
        block = stored[start : start + 100_000].astype(np.float64)
        block /= np.linalg.norm(block, axis=1, keepdims=True)
        scores = block @ q64.T
        rows = scores.argmax(axis=0)
        found = scores[rows, np.arange(len(queries))]
        better = found > best
        best = np.where(better, found, best)
        where = np.where(better, rows + start, where)
    return best, where


def exact_max(stored: Matrix, queries: Matrix) -> npt.NDArray[np.float64]:
    """The exact maximum cosine of each query over every stored vector, in float64."""
    return exact_best(stored, queries)[0]


def corpus_and_queries(count: int) -> tuple[Matrix, Matrix, Matrix]:
    """The real paragraphs' vectors, then `count` near-duplicates (edits of stored
    paragraphs) and `count` fresh paragraphs (not stored), embedded: the same in every run."""
    texts, vectors = memory_corpus.available(REAL_VECTORS)
    if not len(vectors):
        texts, vectors = memory_corpus.vectors(REAL_VECTORS)
    # Fresh: paragraphs past every one that is (or will be) embedded for the memory.
    stored_texts = set(texts)
    extra = [t for t in memory_corpus.texts(REAL_VECTORS + 4 * count) if t not in stored_texts][
        :count
    ]
    rng = random.Random(5)
    picks = rng.sample(range(len(texts)), count)
    print(f"embedding {count} edits and {len(extra)} fresh paragraphs", file=sys.stderr)
    near = embed([edited(texts[i], rng) for i in picks])
    fresh = embed(extra)
    return vectors, near, fresh


def measure_size(
    stored: Matrix, near: Matrix, fresh: Matrix, threshold: int
) -> tuple[dict[str, Any], IndexedCache]:
    n = len(stored)
    rss_before = rss_mb(os.getpid())
    # Loaded whole, as a restart without a saved graph is: the graph is built in a background
    # thread on every entry, its codes trained on all of them, waited for before the queries.
    cache = IndexedCache(capacity=n, index_threshold=threshold)
    ids = [f"kp:trace:{i}" for i in range(n)]
    now = time.time() * 1000
    times = (now - 1000.0 + np.arange(n) * (1000.0 / n)).astype(np.float64)
    started = time.perf_counter()
    cache.load(CacheEntries(stored, times, ids))
    fill_s = time.perf_counter() - started
    while not cache.wait_for_index(600) or cache.index_status().state != "ready":
        time.sleep(0.1)
    # The last entries are inserted by the feeder thread once the graph serves.
    while cache.index_status().indexed < n:
        time.sleep(0.01)
    ready_s = time.perf_counter() - started
    # The exact confirmation's cosine bounds (made in a background thread beside the build).
    while (cache.bounded_range() or (0, 0))[1] < n - BOUND_BATCH:
        time.sleep(0.01)
    bounds_s = time.perf_counter() - started
    status = cache.index_status()
    stats = cache.stats()
    result: dict[str, Any] = {
        "entries": n,
        "index": {"state": status.state, "indexed": status.indexed},
        "trained_on": status.trained_on,
        "fill_s": round(fill_s, 1),
        "index_ready_s": round(ready_s, 1),
        "bounds_ready_s": round(bounds_s, 1),
        "bytes_per_entry": stats.memory_bytes / n,
        "rss_mb": rss_mb(os.getpid()),
        "rss_growth_mb": rss_mb(os.getpid()) - rss_before,
    }
    pauses = GcPauses()
    for name, queries in (("near_duplicates", near), ("fresh", fresh)):
        truth, rows = exact_best(stored, queries)
        answers, named, searched, times_ms = [], [], [], []
        with pauses:
            for q in queries:
                t = time.perf_counter()
                found = cache.nearest(q)
                times_ms.append((time.perf_counter() - t) * 1000)
                assert found is not None
                answers.append(found.cosine)
                named.append(found.trace_id)
                searched.append(found.search)
        got = np.asarray(answers)
        diff = truth - got
        right = np.asarray([name_ == ids[row] for name_, row in zip(named, rows, strict=True)])
        group: dict[str, Any] = {
            "queries": len(queries),
            "recall": float((np.abs(diff) <= 1e-9).mean()),
            "within_0_02": float((diff <= 0.02).mean()),
            "worst_difference": float(diff.max()),
            "query_p50_ms": percentile(times_ms, 50),
            "query_p99_ms": percentile(times_ms, 99),
            "exact_max_median": float(np.median(truth)),
            "answered_by_index": searched.count("index"),
        }
        if name == "near_duplicates":
            mask = truth >= 0.9
            result["near_duplicate_count"] = int(mask.sum())
            result["near_duplicate_recall"] = float((np.abs(diff[mask]) <= 1e-9).mean())
            result["near_duplicate_nearest"] = float(right[mask].mean())
            near_ms = [t for t, m in zip(times_ms, mask, strict=True) if m]
            result["near_duplicate_query_p50_ms"] = percentile(near_ms, 50)
            result["near_duplicate_query_p99_ms"] = percentile(near_ms, 99)
            # The exact confirmation alone (an index answer from CONFIRM_FROM up), pruned by
            # the cosine bounds, given the cosine the index found (here: the true maximum).
            confirm_ms = []
            for q, best in zip(queries, truth, strict=True):
                if best >= CONFIRM_FROM:
                    t = time.perf_counter()
                    cache.nearest_from(q, float(best))
                    confirm_ms.append((time.perf_counter() - t) * 1000)
            group["pruned_confirmation_p50_ms"] = percentile(confirm_ms, 50)
            group["pruned_confirmation_p99_ms"] = percentile(confirm_ms, 99)
            # An index answer at or above CONFIRM_FROM is rescanned exactly: its cost.
            group["answered_exactly_from_0_85"] = int(
                sum(
                    1
                    for a, s_ in zip(answers, searched, strict=True)
                    if a >= 0.85 and s_ == "exact"
                )
            )
        result[name] = group
    result["gc_during_queries"] = pauses.summary()
    both = result["near_duplicates"], result["fresh"]
    result["recall_all"] = float(np.mean([b["recall"] for b in both]))
    result["worst_difference"] = max(b["worst_difference"] for b in both)
    result["query_p50_ms"] = max(b["query_p50_ms"] for b in both)
    result["query_p99_ms"] = max(b["query_p99_ms"] for b in both)
    # The exact scan at this size, for comparison (a few queries: it is the slow path).
    exact = IndexedCache(capacity=n, search="exact")
    exact.load(cache.entries())
    t = time.perf_counter()
    for q in fresh[:20]:
        exact.nearest(q)
    result["exact_scan_ms"] = (time.perf_counter() - t) * 1000 / 20
    del exact
    result |= sustained_feed(cache, stored)
    return result, cache


class GcPauses:
    """The cyclic collector's runs while it is entered, by generation: a full one walks every
    tracked container, the memory's object array of trace ids included (a pause that grows
    with the memory and shows in a query's p99)."""

    def __init__(self) -> None:
        self.runs: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.runs[info["generation"]].append((time.perf_counter() - self._started) * 1000)

    def __enter__(self) -> None:
        gc.callbacks.append(self._callback)

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, Any]:
        return {
            f"generation_{g}": {"runs": len(ms), "max_ms": round(max(ms, default=0.0), 3)}
            for g, ms in self.runs.items()
        }


def sustained_feed(cache: IndexedCache, stored: Matrix) -> dict[str, Any]:
    """Adds into the full memory, each evicting the oldest: the add's own time (index upkeep
    included: the feeder's hand-off, a rebuild's start), then how fast the feeder thread (one
    core) inserts the burst into the graph. A sustained rate of adds above it lengthens the
    exactly-scanned tail."""
    burst = min(20_000, len(stored) // 20)
    adds = derived(stored[: min(len(stored), 100_000)], burst, seed=7)
    add_ms: list[float] = []
    started = time.perf_counter()
    for i, v in enumerate(adds):
        t = time.perf_counter()
        cache.add(v, trace_id=f"kp:trace:new:{i}")
        add_ms.append((time.perf_counter() - t) * 1000)
    added_s = time.perf_counter() - started
    size = cache.size
    deadline = time.monotonic() + 1800
    while cache.index_status().indexed < size and time.monotonic() < deadline:
        time.sleep(0.01)
    fed_s = time.perf_counter() - started
    status = cache.index_status()
    return {
        "add_ms_mean": float(np.mean(add_ms)),
        "add_ms_p99": percentile(add_ms, 99),
        "adds_per_s": burst / added_s,
        "feed_burst": burst,
        "feed_caught_up": status.indexed >= size,
        "feed_builds_total": status.builds_total,
        "feed_s": round(fed_s, 2),
        "feed_per_s": burst / fed_s,
        "feed_burst_add_s": round(added_s, 3),
    }


def check(size: int, figure: str, value: float) -> dict[str, Any]:
    """A figure against its target in TARGETS: at most, or at least for shares and recall."""
    target = TARGETS[figure]
    at_least = figure.startswith(
        ("near_duplicate_recall", "near_duplicate_nearest", "fresh_within")
    )
    return {
        "size": size,
        "figure": figure,
        "value": value,
        "target": f"{'>=' if at_least else '<='} {target}",
        "pass": value >= target if at_least else value <= target,
    }


def checks(result: dict[str, Any]) -> list[dict[str, Any]]:
    n, fresh = result["entries"], result["fresh"]
    return [
        check(n, "near_duplicate_recall", result["near_duplicate_recall"]),
        check(n, "near_duplicate_nearest", result["near_duplicate_nearest"]),
        check(n, "near_duplicate_query_p99_ms", result["near_duplicate_query_p99_ms"]),
        check(n, "fresh_within_0_02", fresh["within_0_02"]),
        check(n, "fresh_worst_difference", fresh["worst_difference"]),
        check(n, "add_ms_mean", result["add_ms_mean"]),
    ]


#: Traces sent to one service before the other takes its turn (service_phase).
SERVICE_BLOCK = 20


def service_phase(stored: Matrix, cache: IndexedCache, workdir: Path) -> dict[str, Any]:
    """Restart on a database of `cache`'s entries; dry-run latency against a 1,000-entry
    service."""
    from app.embedding import model_files
    from app.store.sqlite_memory import Discard, NewRow, SqliteStore
    from bench.server import Server

    files = model_files.resolve(None, None)
    model_id = model_files.identity(files, "float32")
    now = time.time() * 1000
    big, small = workdir / "big.db", workdir / "small.db"
    n = cache.size

    def write(path: Path, entries: CacheEntries) -> None:
        store = SqliteStore(path, model_id, cache.dimensions, "process")
        store.open(Discard())
        ids = entries.ids()
        for start in range(0, len(entries.vectors), 10_000):
            store.write(
                [
                    NewRow(
                        "default",
                        ids[i],
                        float(entries.added_at_ms[i]),
                        entries.vectors[i].astype("<f4").tobytes(),
                    )
                    for i in range(start, min(len(entries.vectors), start + 10_000))
                ]
            )
        store.close()

    t = time.perf_counter()
    write(big, cache.entries())
    write_s = time.perf_counter() - t
    times = (now - 1000.0 + np.arange(1000) * 1.0).astype(np.float64)
    ids = [f"kp:trace:{i}" for i in range(1000)]
    write(small, CacheEntries(stored[-1000:], times, ids))
    common = {
        "KP_EMBEDDER_PRELOAD": "true",
        "KP_EMBEDDER_WORKERS": "1",
        "KP_LOG_LEVEL": "warning",
    }
    out: dict[str, Any] = {"database_write_s": round(write_s, 1), "entries": n}
    started = time.perf_counter()
    large = Server(
        common | {"KP_CACHE_CAPACITY": str(n), "KP_CACHE_DB_PATH": str(big)},
        workdir / "large.log",
        timeout_s=600,
    )
    out["restart_to_healthz_s"] = round(time.perf_counter() - started, 1)
    import httpx

    with httpx.Client(base_url=f"http://127.0.0.1:{large.port}", timeout=60) as c:
        while c.get("/readyz").json()["status"] != "ready":
            time.sleep(0.2)
    out["restart_to_ready_s"] = round(time.perf_counter() - started, 1)
    out["service_rss_mb"] = rss_mb(large.pid)
    smaller = Server(
        common | {"KP_CACHE_CAPACITY": "1000", "KP_CACHE_DB_PATH": str(small)},
        workdir / "small.log",
    )
    with (
        httpx.Client(base_url=f"http://127.0.0.1:{large.port}", timeout=60) as cl,
        httpx.Client(base_url=f"http://127.0.0.1:{smaller.port}", timeout=60) as cs,
    ):
        out |= dry_run_turns(cl, cs)
    large.stop()
    smaller.stop()
    return out


def dry_run_turns(large: Any, small: Any) -> dict[str, float]:
    """Dry-run latency of 200 typical traces on the `large` service's client against the
    `small` one's, p50/p99 each and the ratio of the p50s."""
    from bench import corpus

    items = corpus.build("typical", 200, seed=11)
    lat: dict[str, list[float]] = {"large": [], "small": []}
    for item in items[:10]:  # warm both
        for client in (large, small):
            client.post("/evaluate", params={"dry_run": "true"}, json=item.trace)
    # In turns, a block of traces each: after a run onnxruntime's pool threads spin for a
    # while, and two services on the same cores would each run in the other's spin if they
    # took turns request by request (both slower, the ratio blurred).
    for b, start in enumerate(range(0, len(items), SERVICE_BLOCK)):
        order = (
            (("large", large), ("small", small)) if b % 2 else (("small", small), ("large", large))
        )
        for name, client in order:
            for item in items[start : start + SERVICE_BLOCK]:
                t = time.perf_counter()
                r = client.post("/evaluate", params={"dry_run": "true"}, json=item.trace)
                lat[name].append((time.perf_counter() - t) * 1000)
                assert r.status_code == 200, r.text
                assert r.json()["novelty"]["measured"], r.text
    out: dict[str, float] = {}
    for name, values in lat.items():
        out[f"{name}_p50_ms"] = percentile(values, 50)
        out[f"{name}_p99_ms"] = percentile(values, 99)
    out["request_ratio"] = out["large_p50_ms"] / out["small_p50_ms"]
    return out


def replica_phase(size: int, out: Path) -> dict[str, Any]:
    """`python -m bench.replica` at `size` in a process of its own (its figures file, `out`,
    read back): a new replica joining the shared memory, Redis memory per entry."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.replica", "--size", str(size), "--out", str(out)],
        stderr=subprocess.PIPE,
        text=True,
    )
    sys.stderr.write(done.stderr)
    if done.returncode:  # its last lines say why, for the results file
        raise subprocess.CalledProcessError(
            done.returncode, done.args, stderr="\n".join(done.stderr.splitlines()[-5:])
        )
    doc: dict[str, Any] = json.loads(out.read_text())
    return doc


def run(
    sizes: list[int],
    queries: int,
    service: bool,
    threshold: int,
    replica: bool = False,
    save: Callable[[dict[str, Any]], None] = lambda doc: None,
    replica_out: Path | None = None,
) -> dict[str, Any]:
    """The phase's figures; `save` is given them after each part (a long run that stops
    keeps what it measured), `replica_out` is where bench.replica writes its own file."""
    faiss.omp_set_num_threads(1)  # one core, as the budget is stated
    # The same corpus (and cache) whatever the sizes.
    vectors, near, fresh = corpus_and_queries(queries)
    doc: dict[str, Any] = {
        "cpu": cpu_name(),
        "source": "docstrings of /usr/lib/python3.11 and /usr/lib/python3/dist-packages, "
        "then /usr/share/doc changelog items (bench/memory_corpus.py)",
        "real_vectors": len(vectors),
        "cache": str(memory_corpus.CACHE_DIR),
        "threshold": threshold,
        "sizes": [],
        "checks": [],
    }
    for size in sizes:
        # Past the real vectors embedded so far: derived ones (the module docstring).
        stored = memory_of(vectors, size)
        print(f"memory of {size} entries ...", file=sys.stderr, flush=True)
        result, cache = measure_size(stored, near, fresh, threshold)
        doc["sizes"].append(result)
        doc["checks"] += checks(result)
        save(doc)
        if service and size == max(sizes):
            with tempfile.TemporaryDirectory() as tmp:
                doc["service"] = s = service_phase(stored, cache, Path(tmp))
            doc["checks"] += [
                check(size, "request_ratio", s["request_ratio"]),
                check(size, "restart_to_ready_s", s["restart_to_ready_s"]),
            ]
            save(doc)
        del stored, cache
    if replica:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                doc["replica"] = r = replica_phase(
                    max(sizes), replica_out or Path(tmp) / "replica.json"
                )
            except subprocess.CalledProcessError as exc:  # the figures above are kept
                doc["replica_error"] = f"{exc}: {exc.stderr}"
                doc["checks"].append(check(max(sizes), "replica_to_ready_s", float("inf")))
            else:
                joined = r["shared"]["replica_adopting"]
                doc["checks"].append(
                    check(r["entries"], "replica_to_ready_s", joined["to_ready_s"])
                )
        save(doc)
    return doc


def render(doc: dict[str, Any]) -> str:
    lines = [
        f"memory phase on {doc.get('cpu', 'an unnamed CPU')}, one core a query: real vectors "
        f"{doc['real_vectors']} ({doc['source']}); index from {doc['threshold']} entries",
        "entries   | near-dup recall (n) | fresh recall | all   | worst diff | query p50/p99 ms | exact scan ms | add ms mean/p99 | adds/s  | B/entry | RSS MB",
    ]
    for r in doc["sizes"]:
        lines.append(
            f"{r['entries']:>9} | {r['near_duplicate_recall']:.4f} ({r['near_duplicate_count']:>3})"
            f"     | {r['fresh']['recall']:.4f}       | {r['recall_all']:.4f}"
            f" | {r['worst_difference']:.2e}   | {r['query_p50_ms']:.3f} / {r['query_p99_ms']:.3f}"
            f"    | {r['exact_scan_ms']:.1f}"
            f"          | {r['add_ms_mean']:.4f} / {r['add_ms_p99']:.3f}  | {r['adds_per_s']:>7.0f}"
            f" | {r['bytes_per_entry']:>7.0f} | {r['rss_mb']:.0f}"
        )
    for r in doc["sizes"]:
        if "near_duplicate_nearest" not in r:
            continue  # a results file from before these figures
        near, fresh = r["near_duplicates"], r["fresh"]
        lines.append(
            f"{r['entries']:>9} near-duplicates ({r['near_duplicate_count']}): exact maximum "
            f"{r['near_duplicate_recall']:.4f}, nearest named {r['near_duplicate_nearest']:.4f}, "
            f"p50/p99 {r['near_duplicate_query_p50_ms']:.2f} / "
            f"{r['near_duplicate_query_p99_ms']:.2f} ms ({near['answered_by_index']} answered "
            f"by the index, the rest exactly; the exact confirmation alone "
            f"{near.get('pruned_confirmation_p50_ms', float('nan')):.2f} / "
            f"{near.get('pruned_confirmation_p99_ms', float('nan')):.2f} ms against a full "
            f"scan's {r['exact_scan_ms']:.1f}); fresh: {fresh['within_0_02']:.4f} within 0.02, "
            f"worst {fresh['worst_difference']:.4f}, p50/p99 {fresh['query_p50_ms']:.2f} / "
            f"{fresh['query_p99_ms']:.2f} ms ({fresh['answered_by_index']} by the index); "
            f"codes trained on {r['trained_on']} entries"
        )
    for r in doc["sizes"]:
        full = r["gc_during_queries"]["generation_2"]
        lines.append(
            f"{r['entries']:>9} queries: {full['runs']} full garbage collections ran among them, "
            f"the longest {full['max_ms']} ms"
        )
    for r in doc["sizes"]:
        lines.append(
            f"{r['entries']:>9} full: the feeder (one core) inserted a burst of {r['feed_burst']} "
            f"in {r['feed_s']} s, {r['feed_per_s']:.0f} a second"
            + ("" if r["feed_caught_up"] else " (NOT caught up)")
        )
    if "service" in doc:
        s = doc["service"]
        lines.append(
            f"service at {s['entries']}: database written in {s['database_write_s']} s; "
            f"restart to /healthz {s['restart_to_healthz_s']} s, to ready "
            f"{s['restart_to_ready_s']} s; RSS {s['service_rss_mb']:.0f} MB; dry-run p50 "
            f"{s['large_p50_ms']:.2f} ms vs {s['small_p50_ms']:.2f} ms with 1,000 "
            f"(ratio {s['request_ratio']:.2f}); p99 {s['large_p99_ms']:.2f} vs {s['small_p99_ms']:.2f}"
        )
    if "replica" in doc:
        shared = doc["replica"]["shared"]
        joined = shared["replica_adopting"]
        lines.append(
            f"new replica at {doc['replica']['entries']}: /healthz {joined['to_healthz_s']} s, "
            f"ready {joined['to_ready_s']} s (graphs built {joined['index_builds']}, adopted "
            f"{joined['index_adoptions']}); Redis {shared['redis_bytes_per_entry']} B an entry "
            f"({shared['redis_log_bytes_per_entry']} of log, "
            f"{shared['published_graph_bytes_per_entry']} of published graph)"
        )
    for c in doc["checks"]:
        lines.append(
            f"  {'PASS' if c['pass'] else 'FAIL'}  {c['size']:>9} {c['figure']:<22} "
            f"{c['value']:.4g} (target {c['target']})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.memory", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--sizes", default="100000,1000000")
    parser.add_argument("--queries", type=int, default=QUERIES)
    parser.add_argument("--threshold", type=int, default=20_000)
    parser.add_argument("--no-service", action="store_true", help="skip the service part")
    parser.add_argument(
        "--replica", action="store_true", help="also run bench.replica at the largest size"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(doc: dict[str, Any]) -> None:
        args.out.write_text(json.dumps(doc, indent=2) + "\n")

    doc = run(
        sizes,
        args.queries,
        not args.no_service,
        args.threshold,
        args.replica,
        save,
        args.out.with_name("replica.json"),
    )
    save(doc)
    print(render(doc))
    return 0 if all(c["pass"] for c in doc["checks"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
