"""This checkout against another (the previous release) in one run, A B A B: the lone client's
p50 over the floor and the rate 16 clients get.

    python -m bench versus --former DIR [--rounds 4] [--out bench/results/versus.json]

Each round measures the floor (the bare model, in this process, no server up), then this
checkout's server and the former's, in turn, the order swapped every round (A B, B A, ...).
Every server runs the real model with KP_EMBEDDER_PRELOAD=true and gets traces no server saw
before (repeated texts would hit the embedding memo). The figures are each round's ratio,
this checkout over the former, as the median with its min and max.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import corpus, floor, load
from bench.machine import machine, parse_env, provenance
from bench.server import ROOT, Server

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "versus.json"
CLIENTS = 16


def _server_figures(
    root: Path, log: Path, seed: int, lone: int, seconds: float, env: dict[str, str]
) -> dict[str, float]:
    """One server of `root`: the lone client's typical p50, then 16 clients' rate."""
    warm = corpus.build("typical", 30, seed=seed)
    single = corpus.build("typical", lone, seed=seed + 1)
    crowd = corpus.build("typical", 4000, seed=seed + 2)
    with Server({"KP_EMBEDDER_PRELOAD": "true", **env}, log, root=root) as server:
        port, pid = server.port, server.pid

        async def sequence() -> dict[str, float]:
            await load.closed_loop(port, load.evaluate_requests([i.trace for i in warm], port), 4)
            await load.reset_cache(port)
            bodies = load.evaluate_requests([i.trace for i in single], port)
            one = await load.closed_loop(port, bodies, 1, server_pid=pid)
            await load.reset_cache(port)
            bodies = load.evaluate_requests([i.trace for i in crowd], port)
            many = await load.closed_loop(port, bodies, CLIENTS, max_seconds=seconds)
            return {
                "lone_p50_ms": statistics.median(one.latencies_ms),
                "rate_16_rps": many.throughput_rps,
            }

        return load.run(sequence)


def run(
    former: Path, rounds: int, lone: int, seconds: float, this_env: dict[str, str]
) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="kp-bench-versus-"))
    bare = floor.Floor()
    floor_texts = [i.text for i in corpus.build("typical", 200, seed=7)]
    warm = [i.text for i in corpus.build("typical", 30, seed=8)]
    sides: dict[str, list[dict[str, float]]] = {"this": [], "former": []}
    floors = []
    for r in range(rounds):
        print(f"round {r + 1} of {rounds} ...", file=sys.stderr, flush=True)
        floors.append(bare.measure(floor_texts, warm)["p50_ms"])
        order = [("this", ROOT), ("former", former)]
        for name, root in order if r % 2 == 0 else order[::-1]:
            seed = 1000 * (r + 1) + (0 if name == "this" else 500)
            env = this_env if name == "this" else {}
            figures = _server_figures(root, tmp / f"{name}-{r}.log", seed, lone, seconds, env)
            figures["lone_over_floor"] = figures["lone_p50_ms"] / floors[-1]
            sides[name].append(figures)
    ratios = {
        key: [t[key] / f[key] for t, f in zip(sides["this"], sides["former"], strict=True)]
        for key in ("lone_over_floor", "rate_16_rps")
    }
    return {
        "run": provenance(),
        "machine": machine(),
        "former": str(former),
        "this_env": this_env,
        "floor_p50_ms": floors,
        "this": sides["this"],
        "former_figures": sides["former"],
        "ratio": {
            key: {"median": statistics.median(v), "min": min(v), "max": max(v)}
            for key, v in ratios.items()
        },
    }


def render(doc: dict[str, Any]) -> str:
    lines = [
        f"this checkout over the former, {len(doc['this'])} rounds A B A B ({doc['machine']['cpu']}):"
    ]
    for key, what in (
        ("lone_over_floor", "lone client's typical p50 over the floor (lower is better)"),
        ("rate_16_rps", "16 clients' rate (higher is better)"),
    ):
        r = doc["ratio"][key]
        lines.append(f"  {what}: {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})")
    for name, key in (("this", "this"), ("former", "former_figures")):
        p50 = statistics.median(x["lone_p50_ms"] for x in doc[key])
        rate = statistics.median(x["rate_16_rps"] for x in doc[key])
        lines.append(f"  {name}: lone p50 {p50:.2f} ms, 16 clients {rate:.0f}/s (medians)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench versus", description=__doc__)
    parser.add_argument("--former", type=Path, required=True, help="a checkout to compare with")
    parser.add_argument("--rounds", type=int, default=4, help="A B rounds (default %(default)s)")
    parser.add_argument("--lone", type=int, default=200, help="lone-client traces a server")
    parser.add_argument("--seconds", type=float, default=8.0, help="16 clients' run a server")
    parser.add_argument(
        "--this-env",
        action="append",
        default=[],
        metavar="KP_NAME=VALUE",
        help="a setting for this checkout's servers alone (a default the former lacks: "
        "KP_CACHE_DB_PATH=:memory: compares the memory kept in the process on both sides)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    this_env = parse_env(args.this_env)
    doc = run(args.former.resolve(), args.rounds, args.lone, args.seconds, this_env)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(render(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
