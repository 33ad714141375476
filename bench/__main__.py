"""kp-scoring benchmark: the service over HTTP against the floor of the bare model.

    python -m bench [--quick] [--out bench/results/latest.json]

Starts `uvicorn app.main:app` as a user would (loopback, a free port) and measures latency
and throughput on a fixed corpus, next to the floor: the same texts tokenized and run through a
bare onnxruntime session in a loop. The load generator runs in this process on the same two
cores as the server, so concurrent figures include its cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from app.domain.vector_cache import VectorCache
from app.embedding import model_files
from tests.factories import make_trace, step
from tests.server import LiveServer

WORDS = [
    "ledger",
    "invoice",
    "refund",
    "latency",
    "cache",
    "kernel",
    "patient",
    "dosage",
    "contract",
    "clause",
    "schema",
    "index",
    "query",
    "deploy",
    "rollback",
    "timeout",
    "retry",
    "vector",
    "embedding",
    "token",
    "policy",
    "audit",
    "reconcile",
    "bank",
    "statement",
    "duplicate",
    "posting",
    "review",
    "security",
    "injection",
    "handler",
    "customer",
    "ticket",
]


def corpus(n: int, words: tuple[int, int], seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    traces = []
    for i in range(n):
        count = rng.randint(*words)
        text = " ".join(rng.choice(WORDS) for _ in range(count))
        third = max(1, count // 3)
        parts = text.split()
        steps = [
            step(0, "thought", " ".join(parts[:third])),
            step(1, "tool_call", " ".join(parts[third : 2 * third]), tool="search"),
            step(2, "observation", " ".join(parts[2 * third :])),
        ]
        traces.append(
            make_trace(trace_id=f"kp:trace:bench-{seed}-{i}", objective=f"task {i}", steps=steps)
        )
    return traces


def text_of(trace: dict[str, Any]) -> str:
    return trace["task"]["objective"] + " " + " ".join(s.get("content", "") for s in trace["steps"])


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def summary(ms: list[float]) -> dict[str, float]:
    return {"p50_ms": statistics.median(ms), "p90_ms": pct(ms, 0.9), "p99_ms": pct(ms, 0.99)}


def floor(texts: list[str]) -> dict[str, float]:
    """Bare onnxruntime: tokenize (512 window), run, mean-pool, one text at a time."""
    files = model_files.resolve(None, None)
    tokenizer = Tokenizer.from_file(str(files.tokenizer))
    tokenizer.enable_truncation(512)
    tokenizer.no_padding()
    session = ort.InferenceSession(str(files.model), providers=["CPUExecutionProvider"])
    times = []
    for text in [*texts[:5], *texts]:
        started = time.perf_counter()
        ids = np.asarray([tokenizer.encode(text).ids], dtype=np.int64)
        mask = np.ones_like(ids)
        (hidden,) = session.run(
            ["last_hidden_state"],
            {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)},
        )
        pooled = hidden.mean(axis=1)
        pooled /= np.linalg.norm(pooled, axis=1, keepdims=True)
        times.append((time.perf_counter() - started) * 1000)
    times = times[5:]
    return {**summary(times), "throughput_rps": 1000 / statistics.mean(times)}


def sequential(server: LiveServer, traces: list[dict[str, Any]]) -> dict[str, float]:
    server.client.delete("/cache")
    times = []
    for trace in traces:
        started = time.perf_counter()
        response = server.post("/evaluate", trace)
        times.append((time.perf_counter() - started) * 1000)
        assert response.status_code == 200, response.text
    return summary(times)


async def concurrent(url: str, traces: list[dict[str, Any]], clients: int) -> dict[str, float]:
    queue = list(reversed(traces))
    times: list[float] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        await client.delete("/cache")

        async def worker() -> None:
            while queue:
                trace = queue.pop()
                started = time.perf_counter()
                response = await client.post("/evaluate", json=trace)
                times.append((time.perf_counter() - started) * 1000)
                assert response.status_code == 200, response.text

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        elapsed = time.perf_counter() - started
    return {
        "throughput_rps": len(times) / elapsed,
        "p50_ms": statistics.median(times),
        "p99_ms": pct(times, 0.99),
    }


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def first_requests(env: dict[str, str], trace_list: list[dict[str, Any]], tmp: Path) -> list[float]:
    server = LiveServer({**env, "KP_LOG_LEVEL": "warning"}, tmp / "first.log")
    try:
        times = []
        for trace in trace_list[:10]:
            started = time.perf_counter()
            server.post("/evaluate", trace)
            times.append((time.perf_counter() - started) * 1000)
        return times
    finally:
        server.stop()


def cache_scan() -> dict[str, float]:
    cache = VectorCache(1000)
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((1000, 384)).astype(np.float32)
    for v in vectors / np.linalg.norm(vectors, axis=1, keepdims=True):
        cache.add(v)
    query = vectors[0] / np.linalg.norm(vectors[0])
    times = []
    for _ in range(2000):
        started = time.perf_counter()
        cache.max_cosine_similarity(query)
        times.append((time.perf_counter() - started) * 1e6)
    return {"p50_us": statistics.median(times), "p99_us": pct(times, 0.99)}


def machine() -> dict[str, Any]:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    import os

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "onnxruntime": ort.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def run(quick: bool) -> dict[str, Any]:
    scale = 0.3 if quick else 1.0
    typical = corpus(int(300 * scale), (15, 90), seed=1)  # about 25 to 120 tokens
    long = corpus(int(60 * scale), (600, 900), seed=2)  # the 512-token window full
    tmp = Path(tempfile.mkdtemp(prefix="kp-bench-"))
    results: dict[str, Any] = {"machine": machine()}
    results["floor"] = {
        "typical": floor([text_of(t) for t in typical]),
        "long": floor([text_of(t) for t in long]),
    }
    results["cache_scan_1000"] = cache_scan()

    server = LiveServer(
        {"KP_EMBEDDER_PRELOAD": "true", "KP_LOG_LEVEL": "warning"}, tmp / "server.log"
    )
    try:
        sequential(server, typical[:10])  # warm-up
        results["single_client"] = {
            "typical": sequential(server, typical),
            "long": sequential(server, long),
        }
        results["concurrency"] = {
            str(n): asyncio.run(
                concurrent(server.url, corpus(int(240 * scale), (15, 90), seed=10 + n), n)
            )
            for n in (1, 4, 16, 64)
        }
        results["rss_mb_after_load"] = rss_mb(server.process.pid)
    finally:
        server.stop()

    bare = LiveServer({"KP_EMBEDDER": "none", "KP_LOG_LEVEL": "warning"}, tmp / "none.log")
    try:
        results["no_embedder"] = asyncio.run(concurrent(bare.url, typical * int(8 * scale + 1), 16))
    finally:
        bare.stop()

    cold = first_requests({}, typical, tmp)
    preload = first_requests({"KP_EMBEDDER_PRELOAD": "true"}, typical, tmp)
    results["cold_first_request_ms"] = cold[0]
    results["preload_first_ms"], results["preload_tenth_ms"] = preload[0], preload[9]
    return results


def targets(r: dict[str, Any]) -> list[tuple[str, str, bool]]:
    f, s, c16 = r["floor"], r["single_client"], r["concurrency"]["16"]
    ratio_p50 = s["typical"]["p50_ms"] / f["typical"]["p50_ms"]
    ratio_rps = c16["throughput_rps"] / f["typical"]["throughput_rps"]
    return [
        ("one client typical p50 / floor p50 <= 1.10", f"{ratio_p50:.2f}x", ratio_p50 <= 1.10),
        ("long traces p99 < 100 ms", f"{s['long']['p99_ms']:.1f} ms", s["long"]["p99_ms"] < 100),
        ("16 clients throughput / floor >= 1.3", f"{ratio_rps:.2f}x", ratio_rps >= 1.3),
        ("16 clients p99 < 100 ms", f"{c16['p99_ms']:.1f} ms", c16["p99_ms"] < 100),
        (
            "no embedder >= 2000 evaluations/s",
            f"{r['no_embedder']['throughput_rps']:.0f}/s",
            r["no_embedder"]["throughput_rps"] >= 2000,
        ),
        (
            "cold first request < 1 s",
            f"{r['cold_first_request_ms']:.0f} ms",
            r["cold_first_request_ms"] < 1000,
        ),
        (
            "preload: first <= tenth (+2 ms noise)",
            f"{r['preload_first_ms']:.1f} vs {r['preload_tenth_ms']:.1f} ms",
            r["preload_first_ms"] <= r["preload_tenth_ms"] + 2,
        ),
        (
            "cache scan 1000x384 < 0.1 ms",
            f"{r['cache_scan_1000']['p50_us']:.0f} us",
            r["cache_scan_1000"]["p50_us"] < 100,
        ),
    ]


def report(r: dict[str, Any]) -> str:
    f, s = r["floor"], r["single_client"]
    lines = [
        f"machine: {r['machine']['cpu']}, {r['machine']['cores']} cores, onnxruntime {r['machine']['onnxruntime']}, {r['machine']['date']}",
        "",
        "| measure | service | floor | ratio |",
        "|---|---|---|---|",
    ]
    for kind in ("typical", "long"):
        for q in ("p50_ms", "p90_ms", "p99_ms"):
            lines.append(
                f"| one client, {kind}, {q[:-3]} | {s[kind][q]:.2f} ms | {f[kind][q]:.2f} ms | {s[kind][q] / f[kind][q]:.2f}x |"
            )
    for n, c in r["concurrency"].items():
        lines.append(
            f"| {n} clients, typical: throughput (p50 / p99) | {c['throughput_rps']:.0f}/s ({c['p50_ms']:.1f} / {c['p99_ms']:.1f} ms) "
            f"| {f['typical']['throughput_rps']:.0f}/s | {c['throughput_rps'] / f['typical']['throughput_rps']:.2f}x |"
        )
    nb = r["no_embedder"]
    lines += [
        f"| no embedder, 16 clients | {nb['throughput_rps']:.0f}/s (p50 {nb['p50_ms']:.2f} ms) | | |",
        f"| cold first request (lazy load) | {r['cold_first_request_ms']:.0f} ms | | |",
        f"| preload: first / tenth request | {r['preload_first_ms']:.1f} / {r['preload_tenth_ms']:.1f} ms | | |",
        f"| RSS after load | {r['rss_mb_after_load']:.0f} MB | | |",
        f"| cache scan 1000 x 384 (p50 / p99) | {r['cache_scan_1000']['p50_us']:.0f} / {r['cache_scan_1000']['p99_us']:.0f} us | | |",
        "",
        "targets:",
    ]
    lines += [f"  {'PASS' if ok else 'FAIL'}  {name}: {value}" for name, value, ok in targets(r)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description="kp-scoring benchmark")
    parser.add_argument("--quick", action="store_true", help="fewer requests: a smoke run")
    parser.add_argument("--out", type=Path, default=Path("bench/results/latest.json"))
    args = parser.parse_args()
    results = run(args.quick)
    results["targets"] = [{"target": n, "value": v, "pass": ok} for n, v, ok in targets(results)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(report(results))
    print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
