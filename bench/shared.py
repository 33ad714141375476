"""Shared mode (KP_REDIS_URL): what Redis adds to a request, and how many replicas one Redis
carries.

    python -m bench.shared [--quick] [--out bench/results/shared.json] [--env KP_X=Y]

Both parts run against a Redis 8 with the Query Engine the bench starts (the test extra's, AOF
with an fsync before each reply, as docker-compose.scale.yml runs it); `python -m bench` runs
them too, as a phase.

1. One client, typical traces: the service with KP_REDIS_URL against the service in process,
   in the same run, both loaded, sent the same traces in the same order in alternating blocks
   (so that a busy moment of the machine falls on both). p50 of each and their ratio
   (target <= 1.10x).
2. Redis alone: R simulated replicas (asyncio tasks, each a RedisVectorMemory with its own
   connections) add one 384-float entry a turn to one namespace of CAPACITY entries (its
   search, FLAT, and its add: the service's own step, app/memory/memory.lua). Reported per R:
   steps/s, Redis's CPU per step (its /proc/PID/stat), and the replicas one Redis core
   carries at 150 and 300 evaluations/s each (one step per evaluation). Redis runs scripts on
   one thread: a core is a node's limit; a Redis Cluster spreads namespaces over nodes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from app.core.config import redis_location
from app.memory.redis_vectors import RedisVectorMemory
from bench import corpus, load
from bench.corpus import Item
from bench.machine import machine, parse_env, provenance
from bench.server import Server, cpu_seconds
from bench.stats import median_of_runs, percentile
from tests.server import RedisServer

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "shared.json"
#: Simulated replicas in the Redis throughput part.
REPLICAS = (4, 16, 64)
#: Evaluations a second of one replica (80-300 by CPU and mode) the capacity is quoted for.
REPLICA_RATES = (150, 300)
CAPACITY = 1000


@contextmanager
def redis_server(appendfsync: str = "always") -> Iterator[RedisServer]:
    directory = Path(tempfile.mkdtemp(prefix="kp-bench-redis-"))
    server = RedisServer(directory, appendfsync=appendfsync)
    try:
        yield server
    finally:
        server.stop()


#: The servers of the one-client part: name, Redis's appendfsync (None: in process).
SINGLE_CLIENT = (("in_process", None), ("redis_always", "always"), ("redis_everysec", "everysec"))
ROUNDS = 2


def single_client(
    env: dict[str, str], tmp: Path, typical: list[Item], warm: list[Item]
) -> dict[str, Any]:
    """One client, the same traces to the service in process, with Redis as shipped
    (appendfsync always: an fsync before each answer) and with appendfsync everysec. One server
    runs at a time (idle model processes would take CPU from the measured one); the three take
    turns, ROUNDS times, so that a busy moment of the machine does not fall on one alone."""
    latencies: dict[str, list[float]] = {name: [] for name, _ in SINGLE_CLIENT}
    for round_ in range(ROUNDS):
        for name, fsync in SINGLE_CLIENT:
            with contextlib.ExitStack() as stack:
                settings = {"KP_EMBEDDER_PRELOAD": "true", **env}
                if fsync is not None:
                    settings["KP_REDIS_URL"] = stack.enter_context(redis_server(fsync)).url
                s = stack.enter_context(Server(settings, tmp / f"{name}-{round_}.log"))

                async def sequence(port: int = s.port, name: str = name) -> list[float]:
                    await load.closed_loop(
                        port, load.evaluate_requests([i.trace for i in warm], port), 1
                    )
                    await load.reset_cache(port)
                    phase = await load.closed_loop(
                        port, load.evaluate_requests([i.trace for i in typical], port), 1
                    )
                    if not all(x["novelty"]["measured"] for x in phase.responses()[1:]):
                        raise RuntimeError(
                            f"{name}: novelty not measured: are the model and Redis up?"
                        )
                    return phase.latencies_ms

                latencies[name] += load.run(sequence)
    out: dict[str, Any] = {"requests_each": len(latencies["in_process"])}
    for name, ms in latencies.items():
        out[name] = {"p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99)}
    for name in ("redis_always", "redis_everysec"):
        out[name]["p50_ratio"] = out[name]["p50_ms"] / out["in_process"]["p50_ms"]
    return out


def _memory(url: str) -> RedisVectorMemory:
    return RedisVectorMemory(
        url,
        redis_location(url),
        prefix="kp-bench:",
        capacity=CAPACITY,
        ttl_ms=None,
        timeout_ms=10_000,
        model="bench-model",
    )


def fsync_ms(count: int = 200) -> dict[str, float]:
    """What appendfsync always adds to a step: one client's step time (its search and add),
    with always and with everysec, p50."""
    out = {}
    # Distinct vectors: repeats would tie, and a tie widens the search (memory.lua).
    vectors = np.random.default_rng(0).standard_normal((count + 20, 384)).astype(np.float32)
    for mode in ("always", "everysec"):
        with redis_server(mode) as server:

            async def scenario() -> list[float]:
                memory = _memory(server.url)
                await memory.start()
                times = []
                for i in range(count + 20):
                    started = time.perf_counter()
                    await memory.compare("bench", [vectors[i]], [f"t{i}"], add=True)
                    times.append((time.perf_counter() - started) * 1000)
                await memory.close()
                return times[20:]

            out[f"exchange_p50_ms_{mode}"] = percentile(load.run(scenario), 50)
    return out


def redis_throughput(replicas: int, seconds: float, appendfsync: str) -> dict[str, float]:
    """`replicas` memories adding to one namespace of one Redis for `seconds`."""
    with redis_server(appendfsync) as server:
        assert server.process is not None
        pid = server.process.pid
        # More distinct vectors than the namespace holds: no ties (memory.lua widens on them).
        vectors = np.random.default_rng(0).standard_normal((4 * CAPACITY, 384)).astype(np.float32)

        async def scenario() -> dict[str, float]:
            memories = [_memory(server.url) for _ in range(replicas)]
            for m in memories:
                await m.start()
            counts = {"exchanges": 0}
            measuring = False

            async def replica(n: int, deadline: float) -> None:
                i = 0
                while time.perf_counter() < deadline:
                    vector = vectors[(n * 7919 + i) % len(vectors)]
                    await memories[n].compare("bench", [vector], [f"r{n}-{i}"], add=True)
                    if measuring:
                        counts["exchanges"] += 1
                    i += 1

            # Warm-up: the namespace at capacity.
            await asyncio.gather(*(replica(n, time.perf_counter() + 1.0) for n in range(replicas)))
            measuring = True
            cpu_before, started = cpu_seconds(pid), time.perf_counter()
            await asyncio.gather(*(replica(n, started + seconds) for n in range(replicas)))
            elapsed, cpu = time.perf_counter() - started, cpu_seconds(pid) - cpu_before
            for m in memories:
                await m.close()
            exchanges = counts["exchanges"]
            return {
                "replicas": replicas,
                "exchanges_per_s": exchanges / elapsed,
                "redis_cpu_us_per_exchange": cpu * 1e6 / exchanges,
                "redis_cpu_share": cpu / elapsed,
            }

        return load.run(scenario)


def carried(points: list[dict[str, float]], rate: float) -> int:
    """Replicas one Redis core carries at `rate` evaluations/s each: the largest R with
    R * rate * cpu(R) <= 1 s/s, cpu(R) (Redis CPU per exchange, which grows with the fan-out)
    fitted as a + b * R through the measured points."""
    rs = np.asarray([p["replicas"] for p in points], dtype=np.float64)
    cpu_s = np.asarray([p["redis_cpu_us_per_exchange"] for p in points]) / 1e6
    b, a = np.polyfit(rs, cpu_s, 1)
    r = 1
    while (r + 1) * rate * (a + b * (r + 1)) <= 1.0 and r < 100_000:
        r += 1
    return r


def measure(quick: bool, env: dict[str, str]) -> dict[str, Any]:
    """The shared-mode phase: about 40 s (15 s with `quick`)."""
    tmp = Path(tempfile.mkdtemp(prefix="kp-bench-shared-"))
    typical = corpus.build("typical", 40 if quick else 150, seed=1)
    warm = corpus.build("typical", 10, seed=3)
    out: dict[str, Any] = {"single_client": single_client(env, tmp, typical, warm)}
    out["exchange"] = fsync_ms()
    # Redis as shipped (appendfsync always): its fsyncs wait, they do not use its CPU.
    points = [redis_throughput(r, 1.5 if quick else 4.0, "always") for r in REPLICAS]
    out["redis"] = {str(p["replicas"]): p for p in points}
    out["replicas_carried"] = {str(rate): carried(points, rate) for rate in REPLICA_RATES}
    return out


def rows(s: dict[str, Any]) -> list[str]:
    one, ex = s["single_client"], s["exchange"]
    local = one["in_process"]
    out = []
    for name, label in (
        ("redis_always", "appendfsync always, as shipped"),
        ("redis_everysec", "appendfsync everysec"),
    ):
        r = one[name]
        out.append(
            f"| shared cache ({label}), one client, typical: p50 / p99 ({one['requests_each']} each, servers taking turns) "
            f"| {r['p50_ms']:.2f} / {r['p99_ms']:.2f} ms | {local['p50_ms']:.2f} / {local['p99_ms']:.2f} ms | {r['p50_ratio']:.2f}x |"
        )
    out.append(
        f"| one step in Redis (search and add), one client, p50: appendfsync always / everysec "
        f"| {ex['exchange_p50_ms_always']:.2f} / {ex['exchange_p50_ms_everysec']:.2f} ms | | |"
    )
    for r, p in s["redis"].items():
        out.append(
            f"| Redis alone, {r} replicas, one namespace of {CAPACITY}: steps/s / Redis CPU per step (its share of a core) "
            f"| {p['exchanges_per_s']:.0f}/s / "
            f"{p['redis_cpu_us_per_exchange']:.1f} us ({100 * p['redis_cpu_share']:.0f}%) | | |"
        )
    carried_ = ", ".join(f"{n} at {rate}/s each" for rate, n in s["replicas_carried"].items())
    out.append(f"| replicas one Redis core carries (one step per evaluation) | {carried_} | | |")
    return out


def targets(s: dict[str, Any]) -> list[tuple[str, str, bool]]:
    one = s["single_client"]
    out = []
    for name, label in (
        ("redis_always", "as shipped, appendfsync always"),
        ("redis_everysec", "appendfsync everysec"),
    ):
        r = one[name]
        out.append(
            (
                f"shared cache ({label}), one client: p50 <= 1.10x in-process p50",
                f"{r['p50_ratio']:.2f}x ({r['p50_ms']:.2f} vs {one['in_process']['p50_ms']:.2f} ms)",
                r["p50_ratio"] <= 1.10,
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.shared", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="fewer requests: a smoke run")
    parser.add_argument(
        "--repeat", type=int, default=1, help="whole runs; each figure is their median"
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="JSON results (default %(default)s)"
    )
    parser.add_argument("--env", action="append", default=[], metavar="KP_NAME=VALUE")
    args = parser.parse_args(argv)
    env = parse_env(args.env)
    doc: dict[str, Any] = {
        "run": provenance(),
        "machine": machine(),
        "settings": {"quick": args.quick, "repeat": args.repeat, "env": env},
    }
    started = time.perf_counter()
    runs = []
    for i in range(args.repeat):
        print(f"run {i + 1} of {args.repeat} ...", file=sys.stderr, flush=True)
        runs.append(measure(args.quick, env))
    doc["results"] = median_of_runs(runs)
    if args.repeat > 1:
        doc["runs"] = runs
    doc["duration_s"] = round(time.perf_counter() - started, 1)
    verdicts = targets(doc["results"])
    doc["targets"] = [{"target": n, "value": v, "pass": p} for n, v, p in verdicts]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    m = doc["machine"]
    print(
        f"kp-scoring bench.shared: {m['cpu']}, {m['nproc']} cores, load at start {m['loadavg_start']}, {m['date']}"
    )
    print("\n| measure | shared | in process | ratio |\n|---|---|---|---|")
    print("\n".join(rows(doc["results"])))
    print("\n| target | measured | verdict |\n|---|---|---|")
    for n, v, p in verdicts:
        print(f"| {n} | {v} | {'PASS' if p else 'FAIL'} |")
    print(f"\n{doc['duration_s']} s; written: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
