"""A lone client against services taking turns: which answers one request at a time sooner?

    python -m bench.lone_client [--rounds N] [--kind typical|long] [--base DIR]
                                [--env NAME:KP_X=Y,KP_Z=W ...]

Each variant is a preloaded `python -m app.serve` (the embedding memo off: the rounds send
the same traces again): this checkout as configured by default, another checkout's app with
`--base DIR` (e.g. `git worktree add /tmp/base HEAD~1`, run by this interpreter and its
packages), and this checkout with other KP_* settings for each `--env`. All are started
first; then in each round every variant gets one block (the corpus's 60 typical or 12
full-window traces, one at a time over one keep-alive connection), in an order that turns
from round to round, with a pause between blocks so that one server's threads are idle when
the next one's turn comes. Per variant: the median over the rounds of each block's p50, the
server's CPU per request (all its threads, from /proc), and the median over the rounds of
its block p50 over the first variant's (pairwise, so that a host whose speed moves between
rounds touches both alike). Only ratios within one run mean much on a shared host.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import corpus, load
from bench.server import Server, cpu_seconds
from bench.stats import percentile

#: The memo would answer every round after the first without running the model.
BASE_ENV = {"KP_EMBEDDER_PRELOAD": "true", "KP_EMBED_MEMO_CAPACITY": "0", "KP_LOG_LEVEL": "warning"}
PAUSE_S = 0.2


async def block(port: int, requests: list[bytes]) -> list[float]:
    """Each request's milliseconds, one at a time over one connection."""
    conn = await load.Connection.open(port)
    try:
        times = []
        for request in requests:
            started = time.perf_counter()
            status, body = await conn.exchange(request)
            times.append((time.perf_counter() - started) * 1000)
            if status != 200:
                raise RuntimeError(f"the service answered {status}: {body[:200]!r}")
        return times
    finally:
        await conn.close()


def measure(
    variants: dict[str, tuple[dict[str, str], Path | None]], kind: str, rounds: int
) -> dict[str, Any]:
    items = corpus.build(kind, 60 if kind == "typical" else 12, seed=7)
    traces = [item.trace for item in items]
    p50s: dict[str, list[float]] = {name: [] for name in variants}
    cpu_ms: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        servers: dict[str, Server] = {}
        try:
            for name, (env, root) in variants.items():
                log = Path(tmp) / f"{name}.log"
                servers[name] = (
                    Server(BASE_ENV | env, log)
                    if root is None
                    else Server(BASE_ENV, log, root=root)
                )
            requests = {n: load.evaluate_requests(traces, s.port) for n, s in servers.items()}
            for name, server in servers.items():  # a first block each, not counted
                asyncio.run(block(server.port, requests[name]))
            for i in range(rounds):
                print(f"lone client: round {i + 1} of {rounds}", file=sys.stderr)
                order = list(servers) if i % 2 == 0 else list(reversed(servers))
                for name in order:
                    time.sleep(PAUSE_S)
                    server = servers[name]
                    before = cpu_seconds(server.pid)
                    times = asyncio.run(block(server.port, requests[name]))
                    cpu_ms[name].append((cpu_seconds(server.pid) - before) * 1000 / len(times))
                    p50s[name].append(percentile(times, 50))
        finally:
            for server in servers.values():
                server.stop()
    first = next(iter(variants))
    return {
        "kind": kind,
        "rounds": rounds,
        "load_after": os.getloadavg(),
        "variants": {
            name: {
                "p50_ms": statistics.median(p50s[name]),
                "p50_ms_rounds": p50s[name],
                "server_cpu_ms_per_request": statistics.median(cpu_ms[name]),
                f"p50_over_{first}": statistics.median(
                    [mine / theirs for mine, theirs in zip(p50s[name], p50s[first], strict=True)]
                ),
            }
            for name in variants
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lone_client")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--kind", choices=("typical", "long"), default="typical")
    parser.add_argument("--base", type=Path, help="another checkout whose app to compare")
    parser.add_argument(
        "--env", action="append", default=[], metavar="NAME:KP_X=Y,KP_Z=W", help="a variant"
    )
    args = parser.parse_args(argv)
    variants: dict[str, tuple[dict[str, str], Path | None]] = {"this": ({}, None)}
    if args.base is not None:
        variants["base"] = ({}, args.base.resolve())
    for spec in args.env:
        name, _, settings = spec.partition(":")
        variants[name] = (dict(kv.split("=", 1) for kv in settings.split(",") if kv), None)
    result = measure(variants, args.kind, args.rounds)
    first = next(iter(variants))
    print(
        f"lone client, {args.kind} traces, {args.rounds} rounds (load after {result['load_after']})"
    )
    for name, v in result["variants"].items():
        rounds = ", ".join(f"{x:.2f}" for x in v["p50_ms_rounds"])
        print(
            f"  {name:10s} p50 {v['p50_ms']:.2f} ms (rounds: {rounds}); server CPU "
            f"{v['server_cpu_ms_per_request']:.2f} ms a request; / {first}: "
            f"{v[f'p50_over_{first}']:.3f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
