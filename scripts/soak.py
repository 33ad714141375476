"""Soak run: a real server under steady load for a bounded time, on loopback only.

    python scripts/soak.py --seconds 180 --clients 8

Starts `python -m app.serve` on a free 127.0.0.1 port (real model, the memory kept in SQLite), keeps
`--clients` clients posting distinct traces (with a share of repeats, dry runs, batches,
cache reads and bad payloads) until the time or `--max-requests` is reached, and reports
errors, latency percentiles and the server's RSS over time. Exits 1 if any request got a 5xx
or a transport error, or if RSS grew by more than `--max-rss-growth-mb` after warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.corpus import WORDS
from bench.server import rss_mb
from tests.factories import make_trace, step
from tests.server import LiveServer


def random_trace(rng: random.Random, n: int) -> dict[str, object]:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 60)))
    steps = [step(i, rng.choice(["thought", "tool_call", "observation"]), text) for i in range(3)]
    return make_trace(trace_id=f"kp:trace:soak-{n}", objective=f"task {n} {text[:40]}", steps=steps)


async def client_loop(
    client: httpx.AsyncClient, seed: int, deadline: float, budget: list[int], out: dict[str, list]
) -> None:
    rng = random.Random(seed)
    n = 0
    while time.monotonic() < deadline and budget[0] > 0:
        budget[0] -= 1
        n += 1
        roll = rng.random()
        started = time.perf_counter()
        try:
            if roll < 0.70:
                r = await client.post("/evaluate", json=random_trace(rng, seed * 1_000_000 + n))
            elif roll < 0.80:
                r = await client.post("/evaluate?dry_run=true", json=random_trace(rng, n))
            elif roll < 0.88:
                traces = [random_trace(rng, seed * 1_000_000 + n + i) for i in range(4)]
                r = await client.post("/evaluate/batch", json={"traces": traces})
            elif roll < 0.95:
                r = await client.post(
                    "/evaluate",
                    content=b'{"broken": ',
                    headers={"content-type": "application/json"},
                )
            else:
                r = await client.get("/cache")
        except httpx.TransportError as exc:
            out["transport_errors"].append(repr(exc))
            continue
        out["latency_ms"].append((time.perf_counter() - started) * 1000)
        out["status"].append(r.status_code)


async def soak(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="kp-soak-"))
    env = {
        "KP_EMBEDDER_PRELOAD": "true",
        "KP_CACHE_DB_PATH": str(tmp / "memory.db"),
        "KP_CACHE_SNAPSHOT_INTERVAL_S": "5",
        "KP_LOG_LEVEL": "warning",
    }
    server = LiveServer(env, tmp / "server.log")
    out: dict[str, list] = {"latency_ms": [], "status": [], "transport_errors": []}
    rss: list[tuple[float, float]] = [(0.0, rss_mb(server.process.pid))]
    budget = [args.max_requests]
    started = time.monotonic()
    deadline = started + args.seconds
    try:
        limits = httpx.Limits(max_connections=args.clients)
        async with httpx.AsyncClient(base_url=server.url, timeout=30, limits=limits) as client:
            tasks = [
                asyncio.create_task(client_loop(client, seed, deadline, budget, out))
                for seed in range(args.clients)
            ]
            while not all(t.done() for t in tasks):
                await asyncio.sleep(min(10, args.seconds / 10))
                rss.append((time.monotonic() - started, rss_mb(server.process.pid)))
            await asyncio.gather(*tasks)
        ready = server.client.get("/readyz").json()
    finally:
        server.stop()
    statuses = out["status"]
    latencies = sorted(out["latency_ms"])
    warm = next((mb for t, mb in rss if t >= args.seconds * 0.2), rss[-1][1])
    report = {
        "seconds": round(time.monotonic() - started, 1),
        "clients": args.clients,
        "requests": len(statuses) + len(out["transport_errors"]),
        "by_status": {str(s): statuses.count(s) for s in sorted(set(statuses))},
        "server_errors_5xx": sum(s >= 500 and s != 503 for s in statuses),
        "overloaded_503": statuses.count(503),
        "transport_errors": len(out["transport_errors"]),
        "latency_ms": {
            "p50": round(statistics.median(latencies), 2) if latencies else None,
            "p99": round(latencies[int(len(latencies) * 0.99) - 1], 2) if latencies else None,
            "max": round(latencies[-1], 2) if latencies else None,
        },
        "rss_mb": {
            "start": round(rss[0][1], 1),
            "after_warm_up": round(warm, 1),
            "end": round(rss[-1][1], 1),
        },
        "rss_growth_after_warm_up_mb": round(rss[-1][1] - warm, 1),
        "snapshot": ready["snapshot"]["state"],
        "snapshot_saves": ready["snapshot"]["saves_total"],
        "snapshot_save_errors": ready["snapshot"]["save_errors_total"],
        "log_tracebacks": (tmp / "server.log").read_text(errors="replace").count("Traceback"),
    }
    print(json.dumps(report, indent=2))
    failed = (
        report["server_errors_5xx"]
        or report["transport_errors"]
        or report["log_tracebacks"]
        or report["rss_growth_after_warm_up_mb"] > args.max_rss_growth_mb
    )
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=180)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-requests", type=int, default=200_000)
    parser.add_argument("--max-rss-growth-mb", type=float, default=50)
    return asyncio.run(soak(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
