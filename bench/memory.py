"""The memory phase: the shared memory in Redis's Query Engine at 100,000 entries in one
namespace (and 1,000,000 when the run can afford it), against the exact answer.

    python -m bench.memory [--sizes 100000] [--queries 2000] [--no-service]
        [--ef-runtimes 100,200,400,800]

Vectors (bench.memory_corpus): paragraphs of the docstrings and changelogs Debian's packages
ship, embedded by the service's own model (float32) and cached in ~/.cache/kp-scoring; as
many as are embedded so far are real (the report says how many), the rest derived: each mixes
two random real vectors (weights 1 and 0.5) with 10 % Gaussian noise, renormalised, so it lies
among the real ones rather than in empty space.

The memory is loaded straight into a Redis 8 the bench starts (the memory's own import,
20,000 entries a step; no model), past KP_REDIS_HNSW_FROM, and the phase waits until Redis
has built the namespace's HNSW index and the namespace answers by it. Then the queries, each a
dry-run comparison through the memory (app/memory/redis_vectors.py), answered at each
EF_RUNTIME of --ef-runtimes (an argument of each search: one index serves every value), against
the exact maximum (float64 over every entry):
- near-duplicates: edits of stored texts (about 15 % of their words dropped at random),
  embedded by the model, counted where the exact maximum is >= 0.95: the stored twin must be
  named;
- fresh: real paragraphs that are not stored: within 0.02 of the exact maximum, and how far
  the rest fall.

Figures: those, query p50/p99, Redis's bytes per entry (INFO used_memory over the entries),
the load and index build times. With the service part (default): the dry-run latency of
typical traces on a service whose namespace holds the memory against one whose holds 1,000
(two prefixes of the same Redis, in turns of 20 requests; new traces at each EF_RUNTIME), a new replica's time to /readyz
against the large memory and against an empty one, and its resident memory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from app.core.config import Settings, redis_location
from app.memory.redis_vectors import RedisVectorMemory
from app.memory.ring import CacheEntries
from bench import memory_corpus
from bench.machine import provenance
from bench.server import rss_mb
from bench.stats import percentile
from tests.server import RedisServer

Matrix = npt.NDArray[np.float32]
#: The targets (docs/operating/large-memory.md, docs/operating/scaling.md).
TARGETS = {
    "near_duplicate_nearest": 0.999,  # a near-duplicate (exact >= 0.95) names its twin
    "fresh_within_0_02": 0.99,  # fresh traces within 0.02 of the exact maximum
    "request_ratio": 1.25,  # dry-run typical p50 against a 1,000-entry memory's
    "replica_to_ready_excess_s": 1.0,  # a new replica at size, past one at an empty memory
}
REAL_VECTORS = 100_000
#: Near-duplicate and fresh queries, each.
QUERIES = 2_000
NAMESPACE = "default"
PREFIX = "kp-bench:"
#: Entries from which the namespace answers by HNSW (the service's default).
HNSW_FROM = 10_000
#: The service's default EF_RUNTIME, whose checks decide the exit status.
DEFAULT_EF = Settings.model_fields["redis_hnsw_ef_runtime"].default


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
    row that has it (ties: the newest, the last row, as the memory names them)."""
    best = np.full(len(queries), -1.0)
    where = np.zeros(len(queries), dtype=np.int64)
    q64 = queries.astype(np.float64)
    q64 /= np.linalg.norm(q64, axis=1, keepdims=True)
    for start in range(0, len(stored), 100_000):
        block = stored[start : start + 100_000].astype(np.float64)
        block /= np.linalg.norm(block, axis=1, keepdims=True)
        scores = block @ q64.T
        rows = len(block) - 1 - scores[::-1].argmax(axis=0)
        found = scores[rows, np.arange(len(queries))]
        better = found >= best
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


def _memory(
    url: str, prefix: str, capacity: int, hnsw_from: int = HNSW_FROM, ef_runtime: int | None = None
) -> RedisVectorMemory:
    return RedisVectorMemory(
        url,
        redis_location(url),
        prefix=prefix,
        capacity=capacity,
        ttl_ms=None,
        timeout_ms=60_000,
        model=None,
        hnsw_from=hnsw_from,
        hnsw_ef_runtime=ef_runtime or DEFAULT_EF,
    )


async def fill(memory: RedisVectorMemory, stored: Matrix, namespace: str = NAMESPACE) -> float:
    """The memory's own import, BATCH entries a step; seconds taken."""
    n = len(stored)
    now = time.time() * 1000
    times = (now - 1000.0 + np.arange(n) * (1000.0 / n)).astype(np.float64)
    started = time.perf_counter()
    step = 20_000
    for first in range(0, n, step):
        part = slice(first, min(n, first + step))
        ids = [f"kp:trace:{i}" for i in range(part.start, part.stop)]
        await memory.import_entries(namespace, CacheEntries(stored[part], times[part], ids))
    return time.perf_counter() - started


async def until_hnsw(memory: RedisVectorMemory, probe: Matrix, limit_s: float) -> float:
    """Seconds until the namespace answers by its HNSW index (Redis builds it meanwhile)."""
    started = time.perf_counter()
    while time.perf_counter() - started < limit_s:
        (c,) = await memory.compare(NAMESPACE, [probe], ["probe"], add=False)
        if c.search == "index":
            return time.perf_counter() - started
        await asyncio.sleep(1.0)
    raise TimeoutError(f"no HNSW answer within {limit_s} s")


async def measure_size(
    url: str, stored: Matrix, near: Matrix, fresh: Matrix, ef_runtimes: list[int]
) -> dict[str, Any]:
    """Load `stored`, wait for HNSW, then the queries' answers at each EF_RUNTIME (an argument
    of every search, so one index serves them all)."""
    n = len(stored)
    memory = _memory(url, PREFIX, n)
    await memory.start()
    out: dict[str, Any] = {"entries": n}
    out["fill_s"] = round(await fill(memory, stored), 1)
    out["hnsw_ready_after_fill_s"] = round(await until_hnsw(memory, stored[0], 7200), 1)
    stats = await memory.stats(NAMESPACE)
    out["memory_stats_bytes_per_entry"] = round(stats.memory_bytes / n)
    await memory.close()
    truths = {
        name: exact_best(stored, queries) for name, queries in (("near", near), ("fresh", fresh))
    }
    out["by_ef_runtime"] = []
    for ef in ef_runtimes:
        memory = _memory(url, PREFIX, n, ef_runtime=ef)
        await memory.start()
        group: dict[str, Any] = {"ef_runtime": ef}
        group["near_duplicates"] = await answers(memory, near, *truths["near"])
        group["fresh"] = await answers(memory, fresh, *truths["fresh"])
        out["by_ef_runtime"].append(group)
        await memory.close()
    return out


async def answers(
    memory: RedisVectorMemory,
    queries: Matrix,
    truth: npt.NDArray[np.float64],
    rows: npt.NDArray[np.int64],
) -> dict[str, Any]:
    """The memory's dry-run answers to `queries` against the exact ones."""
    got, named, searched, times_ms = [], [], [], []
    for q in queries:
        t = time.perf_counter()
        (c,) = await memory.compare(NAMESPACE, [q], ["q"], add=False)
        times_ms.append((time.perf_counter() - t) * 1000)
        assert c.max_cosine is not None
        assert c.nearest is not None
        got.append(c.max_cosine)
        named.append(c.nearest.trace_id)
        searched.append(c.search)
    diff = truth - np.asarray(got)
    right = np.asarray([a == f"kp:trace:{r}" for a, r in zip(named, rows, strict=True)])
    twins = truth >= 0.95
    group: dict[str, Any] = {
        "queries": len(queries),
        "exact_max_median": float(np.median(truth)),
        "recall": float((np.abs(diff) <= 1e-9).mean()),
        "within_0_02": float((diff <= 0.02).mean()),
        "worst_difference": float(diff.max()),
        "query_p50_ms": percentile(times_ms, 50),
        "query_p99_ms": percentile(times_ms, 99),
        "answered_by_index": searched.count("index"),
        "twins": int(twins.sum()),
        "twin_named": float(right[twins].mean()) if twins.any() else float("nan"),
    }
    beyond = diff[diff > 0.02]
    if len(beyond):
        group["beyond_0_02"] = {
            "count": len(beyond),
            "p50": float(np.median(beyond)),
            "max": float(beyond.max()),
        }
    return group


def redis_bytes_per_entry(server: RedisServer, entries: int, before: int) -> float:
    with server.client() as client:
        used = int(client.info("memory")["used_memory"])
    return (used - before) / entries


SERVICE_BLOCK = 20


def service_phase(
    server: RedisServer, stored: Matrix, workdir: Path, ef_runtimes: list[int]
) -> dict[str, Any]:
    """A new replica's time to ready; dry-run latency at each EF_RUNTIME against a 1,000-entry
    namespace (which answers by FLAT)."""
    import httpx

    from bench.server import Server

    small_prefix, empty_prefix = "kp-bench-small:", "kp-bench-empty:"

    async def small() -> None:
        memory = _memory(server.url, small_prefix, 1000)
        await memory.start()
        await fill(memory, stored[-1000:])
        await memory.close()

    asyncio.run(small())
    common = {
        "KP_EMBEDDER_PRELOAD": "true",
        "KP_EMBEDDER_WORKERS": "1",
        "KP_LOG_LEVEL": "warning",
        "KP_REDIS_URL": server.url,
        "KP_REDIS_TIMEOUT_MS": "10000",
    }
    out: dict[str, Any] = {"entries": len(stored)}
    for name, prefix in (("empty", empty_prefix), ("large", PREFIX)):
        started = time.perf_counter()
        replica = Server(
            common | {"KP_REDIS_PREFIX": prefix, "KP_CACHE_CAPACITY": str(len(stored))},
            workdir / f"{name}.log",
            timeout_s=600,
        )
        with httpx.Client(base_url=f"http://127.0.0.1:{replica.port}", timeout=60) as c:
            while c.get("/readyz").json()["status"] != "ready":
                time.sleep(0.05)
        out[f"replica_to_ready_{name}_s"] = round(time.perf_counter() - started, 2)
        out[f"replica_rss_{name}_mb"] = round(rss_mb(replica.pid), 1)
        replica.stop()
    out["replica_to_ready_excess_s"] = round(
        out["replica_to_ready_large_s"] - out["replica_to_ready_empty_s"], 2
    )
    smaller = Server(
        common | {"KP_REDIS_PREFIX": small_prefix, "KP_CACHE_CAPACITY": "1000"},
        workdir / "small.log",
    )
    out["dry_run_by_ef_runtime"] = []
    for i, ef in enumerate(ef_runtimes):
        large = Server(
            common
            | {
                "KP_REDIS_PREFIX": PREFIX,
                "KP_CACHE_CAPACITY": str(len(stored)),
                "KP_REDIS_HNSW_EF_RUNTIME": str(ef),
            },
            workdir / f"large-{ef}.log",
        )
        with (
            httpx.Client(base_url=f"http://127.0.0.1:{large.port}", timeout=60) as cl,
            httpx.Client(base_url=f"http://127.0.0.1:{smaller.port}", timeout=60) as cs,
        ):
            turns = {"ef_runtime": ef} | dry_run_turns(cl, cs, seed=11 + i)
        turns["replica_rss_after_requests_mb"] = round(rss_mb(large.pid), 1)
        out["dry_run_by_ef_runtime"].append(turns)
        large.stop()
    smaller.stop()
    return out


def dry_run_turns(large: Any, small: Any, seed: int = 11) -> dict[str, Any]:
    """Dry-run latency of 200 typical traces on the `large` service's client against the
    `small` one's, p50/p99 each and the ratio of the p50s. A new `seed` for each call on the
    same services: repeated texts would hit the embedding memo."""
    from bench import corpus

    items = corpus.build("typical", 200, seed=seed)
    lat: dict[str, list[float]] = {"large": [], "small": []}
    searched: list[str] = []
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
                if name == "large":
                    searched.append(r.json()["novelty"]["search"])
    out: dict[str, Any] = {"large_answered_by_index": searched.count("index")}
    for name, values in lat.items():
        out[f"{name}_p50_ms"] = percentile(values, 50)
        out[f"{name}_p99_ms"] = percentile(values, 99)
    out["request_ratio"] = out["large_p50_ms"] / out["small_p50_ms"]
    return out


def check(size: int, ef: int | None, figure: str, value: float) -> dict[str, Any]:
    target = TARGETS[figure]
    at_least = figure in ("near_duplicate_nearest", "fresh_within_0_02")
    ok = value >= target if at_least else value <= target
    return {
        "size": size,
        "ef_runtime": ef,
        "figure": figure,
        "value": value,
        "target": target,
        "pass": bool(ok),
    }


def run(
    sizes: list[int],
    queries: int,
    service: bool,
    ef_runtimes: list[int] | None = None,
    save: Callable[[dict[str, Any]], None] = lambda doc: None,
) -> dict[str, Any]:
    """The phase's figures at each of `ef_runtimes` (the service's default alone if None);
    `save` is given them after each part (a long run that stops keeps what it measured)."""
    ef_runtimes = ef_runtimes or [DEFAULT_EF]
    vectors, near, fresh = corpus_and_queries(queries)
    doc: dict[str, Any] = {
        "run": provenance(),
        "cpu": cpu_name(),
        "source": "docstrings of /usr/lib/python3.11 and /usr/lib/python3/dist-packages, "
        "then /usr/share/doc changelog items (bench/memory_corpus.py)",
        "real_vectors": len(vectors),
        "hnsw_from": HNSW_FROM,
        "ef_runtimes": ef_runtimes,
        "sizes": [],
        "checks": [],
    }
    for size in sizes:
        stored = memory_of(vectors, size)
        print(f"memory of {size} entries ...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            server = RedisServer(Path(tmp), appendfsync="everysec")
            try:
                with server.client() as client:
                    before = int(client.info("memory")["used_memory"])
                result = asyncio.run(measure_size(server.url, stored, near, fresh, ef_runtimes))
                result["redis_bytes_per_entry"] = round(redis_bytes_per_entry(server, size, before))
                doc["sizes"].append(result)
                for g in result["by_ef_runtime"]:
                    ef = g["ef_runtime"]
                    doc["checks"] += [
                        check(
                            size, ef, "near_duplicate_nearest", g["near_duplicates"]["twin_named"]
                        ),
                        check(size, ef, "fresh_within_0_02", g["fresh"]["within_0_02"]),
                    ]
                save(doc)
                if service and size == max(sizes):
                    doc["service"] = s = service_phase(server, stored, Path(tmp), ef_runtimes)
                    doc["checks"].append(
                        check(
                            size, None, "replica_to_ready_excess_s", s["replica_to_ready_excess_s"]
                        )
                    )
                    doc["checks"] += [
                        check(size, t["ef_runtime"], "request_ratio", t["request_ratio"])
                        for t in s["dry_run_by_ef_runtime"]
                    ]
                    save(doc)
            finally:
                server.stop()
        del stored
    return doc


def render(doc: dict[str, Any]) -> str:
    lines = [
        f"memory phase (Redis's Query Engine, one namespace) on {doc.get('cpu', 'an unnamed CPU')}: "
        f"real vectors {doc['real_vectors']} ({doc['source']}); HNSW from {doc['hnsw_from']} entries",
    ]
    for r in doc["sizes"]:
        lines.append(
            f"{r['entries']:>9}: Redis {r['redis_bytes_per_entry']} B an entry; import "
            f"{r['fill_s']} s, HNSW answering {r['hnsw_ready_after_fill_s']} s after it"
        )
        for g in r["by_ef_runtime"]:
            near, fresh = g["near_duplicates"], g["fresh"]
            rest = fresh.get("beyond_0_02")
            lines.append(
                f"  EF_RUNTIME {g['ef_runtime']}: near-duplicates (exact >= 0.95: {near['twins']}) "
                f"twin named {near['twin_named']:.4f}, p50/p99 {near['query_p50_ms']:.2f} / "
                f"{near['query_p99_ms']:.2f} ms; fresh within 0.02 {fresh['within_0_02']:.4f}, "
                f"exact maximum found {fresh['recall']:.4f}, worst {fresh['worst_difference']:.4f}"
                + (f" (the {rest['count']} past 0.02: median {rest['p50']:.4f})" if rest else "")
                + f", p50/p99 {fresh['query_p50_ms']:.2f} / {fresh['query_p99_ms']:.2f} ms"
            )
    if "service" in doc:
        s = doc["service"]
        lines.append(
            f"service at {s['entries']}: a new replica ready in {s['replica_to_ready_large_s']} s "
            f"against {s['replica_to_ready_empty_s']} s at an empty memory, RSS "
            f"{s['replica_rss_large_mb']:.0f} MB against {s['replica_rss_empty_mb']:.0f} MB"
        )
        for t in s["dry_run_by_ef_runtime"]:
            lines.append(
                f"  EF_RUNTIME {t['ef_runtime']}: dry-run p50 {t['large_p50_ms']:.2f} ms vs "
                f"{t['small_p50_ms']:.2f} ms with 1,000 (ratio {t['request_ratio']:.2f}); p99 "
                f"{t['large_p99_ms']:.2f} vs {t['small_p99_ms']:.2f}"
            )
    for c in doc["checks"]:
        lines.append(
            f"  {'PASS' if c['pass'] else 'FAIL'}  {c['size']:>9} EF {c['ef_runtime'] or '-':>4} "
            f"{c['figure']:<26} {c['value']:.4g} (target {c['target']})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.memory", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--sizes", default="100000")
    parser.add_argument("--queries", type=int, default=QUERIES)
    parser.add_argument("--no-service", action="store_true", help="skip the service part")
    parser.add_argument(
        "--ef-runtimes",
        default="100,200,400,800",
        help="HNSW EF_RUNTIME values to answer with, each against the same index",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(doc: dict[str, Any]) -> None:
        args.out.write_text(json.dumps(doc, indent=2) + "\n")

    ef_runtimes = [int(e) for e in args.ef_runtimes.split(",")]
    doc = run(sizes, args.queries, not args.no_service, ef_runtimes, save)
    save(doc)
    print(render(doc))
    return (
        0 if all(c["pass"] for c in doc["checks"] if c["ef_runtime"] in (None, DEFAULT_EF)) else 1
    )


if __name__ == "__main__":
    raise SystemExit(main())
