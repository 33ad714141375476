"""kp-scoring benchmark: the service over HTTP against the floor of the bare model.

    python -m bench [PHASE] [--quick] ...

Phases (default: all; `python -m bench PHASE --help` for each one's options):

- floor: the bare onnxruntime session, one text at a time (tokenization included);
- load: one client (typical and long traces) and 1 to 64 clients, the floor measured
  before and after, ratios service / floor;
- cold: fresh service processes' first answer against the floor's own load and first run;
- window: megabyte traces against full-window ones, and /healthz meanwhile;
- reference: the reference SDK in node side by side (bench/reference.py);
- memory: the shared memory in Redis's Query Engine at size (bench/memory.py);
- shared: the shared mode over Redis (bench/shared.py);
- precision: int8 mode against float32, in process (bench/precision.py);
- persistence: what keeping the in-process memory in SQLite costs a trace, an import and a
  start, side by side with the former snapshot and journal (bench/persistence.py);
- contribution: POST /contribution against POST /evaluate on the same traces, and on
  megabyte traces against a full model window (bench/contribution.py);
- versus: this checkout against another one (the previous release), A B A B: the lone
  client's p50 over the floor and 16 clients' rate (bench/versus.py);
- detectors: what the contribution gate's leak detectors find, raise falsely and cost, in
  process (bench/detectors.py);
- all: every figure of bench/results/latest.json (floor, load, window, shared, first
  requests), then the reference and memory phases. See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from app.memory.ring import VectorCache
from bench import (
    cold_start,
    contribution,
    corpus,
    detectors,
    floor,
    load,
    megabyte,
    memory,
    persistence,
    precision,
    reference,
    shared,
    versus,
)
from bench.corpus import Item
from bench.floor import Floor
from bench.machine import loadavg, machine, parse_env, provenance
from bench.report import megabyte_table, render, targets
from bench.server import Server, rss_mb
from bench.stats import latency_summary, median_of_runs, percentile

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "latest.json"
CONCURRENCY = (1, 4, 16, 64)
#: Requests sent at once (the admission target: every one answered 200).
BURST = 64
#: Open-loop arrival rates, in % of the capacity the 16-client level measured.
OPEN_LOOP_SHARES = (50, 80)
PRELOAD_SERVERS = 3


class Sizes:
    def __init__(self, quick: bool) -> None:
        self.typical = 60 if quick else 300
        self.long = 15 if quick else 60
        self.warmup = 10 if quick else 30
        self.per_level = (
            80 if quick else 320
        )  # requests per concurrency level (at least 8 x clients)
        self.level_seconds = 3.0 if quick else 10.0
        self.no_embedder_seconds = 1.5 if quick else 4.0
        self.scans = 500 if quick else 5000
        self.quick = quick
        self.megabyte = 4 if quick else 15  # traces of each kind, sent side by side
        self.megabyte_load_seconds = 3.0 if quick else 8.0


# ── phases ────────────────────────────────────────────────────────────────


def measure_floor(
    sizes: Sizes, typical: list[Item], long: list[Item], warm: list[Item]
) -> dict[str, Any]:
    bare = Floor()
    warmup = [i.text for i in warm]
    return {
        "typical": bare.measure([i.text for i in typical], warmup),
        "long": bare.measure([i.text for i in long], warmup[:5]),
    }


def cache_scan(count: int) -> dict[str, float]:
    """nearest on a full VectorCache(1000) of unit vectors, in microseconds."""
    cache = VectorCache(1000)
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((1001, 384)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    for v in vectors[:1000]:
        cache.add(v)
    query = vectors[1000]
    for _ in range(100):
        cache.nearest(query)
    times = []
    for _ in range(count):
        started = time.perf_counter()
        cache.nearest(query)
        times.append((time.perf_counter() - started) * 1e6)
    return {"p50_us": statistics.median(times), "p99_us": percentile(times, 99)}


def _phase_figures(phase: load.Phase, expect_measured: bool) -> dict[str, Any]:
    responses = phase.responses()
    if expect_measured:
        # Each response but the first after a reset compares against the cache.
        unmeasured = sum(1 for x in responses if not x["novelty"]["measured"])
        if unmeasured > phase.clients:
            raise RuntimeError(
                f"{unmeasured} responses without a measured novelty: is the model up?"
            )
    away = phase.turned_away_ms
    return {
        **latency_summary(phase.latencies_ms),
        "throughput_rps": phase.throughput_rps,
        "turned_away": len(away),
        "turned_away_share": len(away) / (len(away) + phase.count),
        "turned_away_p99_ms": percentile(away, 99) if away else 0.0,
        "service_elapsed_p50_ms": percentile([x["elapsed_ms"] for x in responses], 50),
        "server_cpu_ms_per_request": phase.server_cpu_s * 1000 / phase.count,
        "event_loop_cpu_ms_per_request": phase.event_loop_cpu_s * 1000 / phase.count,
        "client_cpu_ms_per_request": phase.client_cpu_s * 1000 / phase.count,
        "truncated": sum(1 for x in responses if x["novelty"].get("truncated")),
    }


def embedder_server(
    sizes: Sizes,
    env: dict[str, str],
    tmp: Path,
    typical: list[Item],
    long: list[Item],
    warm: list[Item],
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with Server({"KP_EMBEDDER_PRELOAD": "true", **env}, tmp / "server.log") as server:
        port, pid = server.port, server.pid

        def requests(items: list[Item]) -> list[bytes]:
            return load.evaluate_requests([i.trace for i in items], port)

        async def sequence() -> None:
            await load.closed_loop(port, requests(warm), 1)
            await load.closed_loop(port, requests(warm[:4]), 4)
            single = {}
            for kind, items in (("typical", typical), ("long", long)):
                await load.reset_cache(port)
                phase = await load.closed_loop(port, requests(items), 1, server_pid=pid)
                single[kind] = _phase_figures(phase, expect_measured=True)
            out["single_client"] = single
            levels = {}
            for n in CONCURRENCY:
                items = corpus.build("typical", max(sizes.per_level, 8 * n), seed=100 + n)
                await load.reset_cache(port)
                phase = await load.closed_loop(
                    port, requests(items), n, max_seconds=sizes.level_seconds, server_pid=pid
                )
                levels[str(n)] = _phase_figures(phase, expect_measured=True)
            out["concurrency"] = levels
            await load.reset_cache(port)
            burst = corpus.build("typical", BURST, seed=200)
            phase = await load.closed_loop(port, requests(burst), BURST, server_pid=pid)
            out["burst"] = _phase_figures(phase, expect_measured=True)
            capacity = levels["16"]["throughput_rps"]
            arrivals = {}
            for share in OPEN_LOOP_SHARES:
                rate = capacity * share / 100
                items = corpus.build("typical", int(rate * sizes.level_seconds), seed=300 + share)
                await load.reset_cache(port)
                open_phase = await load.open_loop(port, requests(items), rate, seed=share)
                arrivals[str(share)] = {
                    "offered_rps": rate,
                    "achieved_rps": open_phase.achieved_rps,
                    "turned_away": open_phase.turned_away,
                    **latency_summary(open_phase.latencies_ms),
                }
            out["open_loop"] = arrivals

        load.run(sequence)
        out["rss_mb_after_load"] = rss_mb(pid)
        out["rss_peak_mb"] = rss_mb(pid, "VmHWM")
    return out


def no_embedder(sizes: Sizes, tmp: Path, typical: list[Item]) -> dict[str, Any]:
    with Server({"KP_EMBEDDER": "none"}, tmp / "none.log") as server:
        port = server.port
        bodies = load.evaluate_requests([i.trace for i in typical], port)
        many = bodies * (1 + int(6000 * sizes.no_embedder_seconds) // len(bodies))

        async def sequence() -> load.Phase:
            await load.closed_loop(port, bodies[:200], 16)
            return await load.closed_loop(
                port, many, 16, max_seconds=sizes.no_embedder_seconds, server_pid=server.pid
            )

        return _phase_figures(load.run(sequence), expect_measured=False)


def first_requests(env: dict[str, str], tmp: Path, items: list[Item], name: str) -> dict[str, Any]:
    """A fresh server: seconds to /healthz, then ten requests one after the other (ms)."""
    with Server(env, tmp / f"{name}.log") as server:
        requests = load.evaluate_requests([i.trace for i in items[:10]], server.port)

        async def sequence() -> list[float]:
            times = []
            for request in requests:
                status, body, ms = await load.call(server.port, request)
                if status != 200:
                    raise RuntimeError(f"{name}: POST /evaluate answered {status}: {body[:300]!r}")
                times.append(ms)
            return times

        times = load.run(sequence)
        return {"server_start_s": server.started_s, "times_ms": times}


def measure(sizes: Sizes, env: dict[str, str], items: dict[str, list[Item]]) -> dict[str, Any]:
    """One whole measurement: every figure once."""
    typical, long, warm = items["typical"], items["long"], items["warm"]
    tmp = Path(tempfile.mkdtemp(prefix="kp-bench-"))
    r: dict[str, Any] = {}
    # The floor runs in process while no server runs, between the service's phases.
    floors = [measure_floor(sizes, typical, long, warm)]
    r["cache_scan"] = cache_scan(sizes.scans)
    r |= embedder_server(sizes, env, tmp, typical, long, warm)
    floors.append(measure_floor(sizes, typical, long, warm))
    r["megabyte"] = megabyte.measure(
        env,
        tmp / "megabyte.log",
        long[: sizes.megabyte],
        {kind: items[f"megabyte_{kind}"] for kind in corpus.MEGABYTE_KINDS},
        sizes.megabyte_load_seconds,
    )
    floors.append(measure_floor(sizes, typical, long, warm))
    r["no_embedder"] = no_embedder(sizes, tmp, typical)
    floors.append(measure_floor(sizes, typical, long, warm))
    r["floor"] = floor.combine(floors)
    r["shared"] = shared.measure(sizes.quick, env)
    cold = first_requests(env, tmp, items["cold"], "cold")
    r["cold"] = {"server_start_s": cold["server_start_s"], "first_request_ms": cold["times_ms"][0]}
    r["preload"] = preload(env, tmp, items["cold"][0])
    return r


def preload(env: dict[str, str], tmp: Path, item: Item) -> dict[str, float]:
    """Fresh preloaded servers, each sent one trace ten times: the first request against the
    tenth like for like (ten different texts would differ by their lengths), each figure the
    median over the servers."""
    runs = [
        first_requests({**env, "KP_EMBEDDER_PRELOAD": "true"}, tmp, [item] * 10, f"preload-{i}")
        for i in range(PRELOAD_SERVERS)
    ]
    return {
        "server_start_s": statistics.median(run["server_start_s"] for run in runs),
        "first_ms": statistics.median(run["times_ms"][0] for run in runs),
        "tenth_ms": statistics.median(run["times_ms"][9] for run in runs),
        "median_2_10_ms": statistics.median(t for run in runs for t in run["times_ms"][1:]),
    }


# ── the document ──────────────────────────────────────────────────────────


def notes(doc: dict[str, Any]) -> list[str]:
    m, r = doc["machine"], doc["results"]
    c16 = r["concurrency"]["16"]
    share = c16["client_cpu_ms_per_request"] / (
        c16["client_cpu_ms_per_request"] + c16["server_cpu_ms_per_request"]
    )
    out = [
        f"The load generator (asyncio, raw HTTP/1.1 keep-alive, in the bench process) shares the {m['nproc']} cores "
        f"with the server: at 16 clients it used {100 * share:.1f}% of the CPU spent per request, so concurrent and "
        "no-embedder throughputs are lower than a separate client machine would see.",
        "The floor runs in the bench process with no server running; its throughput is one text at a time "
        "(no batching), its latency includes tokenization and pooling. "
        + _floor_spread(r["floor"]),
        "Cold start is a fresh process with a warm OS page cache (the model file was read before).",
        "Server settings: as a user runs it (log level info, one JSON access line a request), plus "
        + (", ".join(f"{k}={v}" for k, v in doc["settings"]["env"].items()) or "no KP_* overrides")
        + "; KP_EMBEDDER_PRELOAD=true for the latency and concurrency server.",
    ]
    if doc["settings"]["env"].get("KP_EMBEDDER_PRECISION") == "int8":
        out.append(
            "The service runs in int8 mode; the floor is still the float32 model of the default "
            "mode, so the ratios say what int8 mode gains over it (python -m bench precision "
            "compares the two modes' model runs directly)."
        )
    load1 = float(m["loadavg_start"].split()[0])
    if load1 > 0.3 * m["nproc"]:
        out.append(
            f"WARNING: the machine was busy at the start (load {m['loadavg_start']}): figures are pessimistic."
        )
    return out


def _floor_spread(f: dict[str, Any]) -> str:
    """Results written before the floor was interleaved have one sample and no spread."""
    if "spread" not in f:
        return "It was measured once, before the service."
    s = f["spread"]
    p50, rps = s["typical"]["p50_ms"], s["typical"]["throughput_rps"]
    return (
        f"It was measured {s['samples']} times, alternating with the service's phases; the ratios use "
        f"each figure's median. Typical p50 {p50['min']:.2f}-{p50['max']:.2f} ms (spread "
        f"{p50['spread_pct']:.1f}%), throughput {rps['min']:.0f}-{rps['max']:.0f}/s "
        f"(spread {rps['spread_pct']:.1f}%)."
    )


#: Phases with a module and options of their own: `python -m bench PHASE ARGS` is its main(ARGS).
DELEGATED = {
    "cold": cold_start.main,
    "reference": reference.main,
    "memory": memory.main,
    "shared": shared.main,
    "precision": precision.main,
    "persistence": persistence.main,
    "contribution": contribution.main,
    "versus": versus.main,
    "detectors": detectors.main,
}
PHASES = ("all", "floor", "load", "window", *DELEGATED)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in DELEGATED:
        return DELEGATED[argv[0]](argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "phase", nargs="?", default="all", choices=PHASES, help="what to measure (default: all)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer requests: a smoke run")
    parser.add_argument(
        "--repeat", type=int, default=1, help="whole runs (all); each figure is their median"
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="JSON results of all (default %(default)s)"
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KP_NAME=VALUE",
        help="extra setting for the embedder servers",
    )
    parser.add_argument(
        "--memory",
        default="100000",
        metavar="SIZES",
        help="all: the memory phase's sizes (bench.memory: the shared memory in Redis, real "
        "MiniLM vectors, recall, latency); 'off' to skip; --quick skips it",
    )
    parser.add_argument(
        "--reference",
        choices=("auto", "skip"),
        default="auto",
        help="all: the reference SDK side by side (bench/reference.py) when it is set up "
        "(auto), or not at all",
    )
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    sizes = Sizes(args.quick)
    env = parse_env(args.env)
    items = {
        "typical": corpus.build("typical", sizes.typical, seed=1),
        "long": corpus.build("long", sizes.long, seed=2),
        "warm": corpus.build("typical", sizes.warmup, seed=3),
        "cold": corpus.build("typical", 10, seed=4),
    }
    if args.phase == "floor":
        return _print_floor(measure_floor(sizes, items["typical"], items["long"], items["warm"]))
    if args.phase == "load":
        return _load_phase(sizes, env, items)
    for kind in corpus.MEGABYTE_KINDS:
        items[f"megabyte_{kind}"] = corpus.megabyte(kind, sizes.megabyte, seed=5)
    if args.phase == "window":
        return _window_phase(sizes, env, items)
    return _all(args, sizes, env, items)


def _print_floor(f: dict[str, Any]) -> int:
    m = machine()
    print(f"floor: bare onnxruntime, one text at a time; {m['cpu']}, {m['nproc']} cores")
    for kind in ("typical", "long"):
        x = f[kind]
        print(
            f"  {kind}: p50 {x['p50_ms']:.2f} ms, p99 {x['p99_ms']:.2f} ms, "
            f"{x['throughput_rps']:.0f} texts/s"
        )
    return 0


def _load_phase(sizes: Sizes, env: dict[str, str], items: dict[str, list[Item]]) -> int:
    """One client and 1 to 64 clients, the floor measured before and after (no server up)."""
    typical, long, warm = items["typical"], items["long"], items["warm"]
    tmp = Path(tempfile.mkdtemp(prefix="kp-bench-"))
    floors = [measure_floor(sizes, typical, long, warm)]
    r = embedder_server(sizes, env, tmp, typical, long, warm)
    floors.append(measure_floor(sizes, typical, long, warm))
    f = floor.combine(floors)
    m = machine()
    print(f"load: {m['cpu']}, {m['nproc']} cores; settings {env or 'default'}")
    for kind in ("typical", "long"):
        s, b = r["single_client"][kind], f[kind]
        print(
            f"  one client, {kind}: p50 {s['p50_ms']:.2f} ms ({s['p50_ms'] / b['p50_ms']:.2f}x "
            f"the floor's {b['p50_ms']:.2f}), p99 {s['p99_ms']:.2f} ms"
        )
    for n, c in r["concurrency"].items():
        print(
            f"  {n} client(s), typical: {c['throughput_rps']:.0f}/s "
            f"({c['throughput_rps'] / f['typical']['throughput_rps']:.2f}x the floor's one at a "
            f"time), p50 {c['p50_ms']:.1f} ms, p99 {c['p99_ms']:.1f} ms, "
            f"{c['turned_away']} turned away"
        )
    return 0


def _window_phase(sizes: Sizes, env: dict[str, str], items: dict[str, list[Item]]) -> int:
    """Megabyte traces against full-window ones (the 512-token window's cost)."""
    tmp = Path(tempfile.mkdtemp(prefix="kp-bench-"))
    m = megabyte.measure(
        env,
        tmp / "megabyte.log",
        items["long"][: sizes.megabyte],
        {kind: items[f"megabyte_{kind}"] for kind in corpus.MEGABYTE_KINDS},
        sizes.megabyte_load_seconds,
    )
    print("\n".join(megabyte_table(m)))
    return 0


def _all(
    args: argparse.Namespace, sizes: Sizes, env: dict[str, str], items: dict[str, list[Item]]
) -> int:
    doc: dict[str, Any] = {"run": provenance(), "machine": machine()}
    doc["settings"] = {"quick": args.quick, "repeat": args.repeat, "env": env}
    doc["corpus"] = {
        "typical": corpus.describe(items["typical"]),
        "long": corpus.describe(items["long"]),
        "megabyte": {
            kind: corpus.describe_megabyte(items[f"megabyte_{kind}"])
            for kind in corpus.MEGABYTE_KINDS
        },
    }
    started = time.perf_counter()
    where = reference.available() if args.reference != "skip" else "--reference skip"
    runs = []
    for i in range(args.repeat):
        print(f"run {i + 1} of {args.repeat} ...", file=sys.stderr, flush=True)
        runs.append(measure(sizes, env, items))
    doc["results"] = median_of_runs(runs)
    if args.repeat > 1:
        doc["runs"] = runs
    if isinstance(where, Path):
        # Its own interleaved rounds (at least 3), after the runs above, with no server of theirs up.
        doc["reference"] = reference.measure(where, max(3, args.repeat), args.quick, env=env)
    else:
        doc["reference_skipped"] = where
        print(f"reference phase skipped: {where}", file=sys.stderr)
    doc["loadavg_end"] = loadavg()
    doc["duration_s"] = round(time.perf_counter() - started, 1)
    doc["targets"] = [t.as_json() for t in targets(doc["results"])]
    if "reference" in doc:
        doc["targets"] += [
            {"target": n, "value": v, "pass": ok}
            for n, v, ok in reference.targets(doc["reference"])
        ]
    doc["notes"] = notes(doc)
    if not args.quick and args.memory != "off":
        print("memory phase ...", file=sys.stderr, flush=True)
        sizes_of_memory = [int(n) for n in args.memory.split(",")]
        doc["memory"] = memory.run(sizes_of_memory, memory.QUERIES, service=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(render(doc))
    if "memory" in doc:
        print()
        print(memory.render(doc["memory"]))
    print(f"\n{doc['duration_s']} s; written: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
