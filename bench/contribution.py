"""What POST /contribution costs over POST /evaluate (docs/contribution.md): the same traces
sent to both routes, side by side, on one server; and megabyte traces through /contribution
against full-window traces through /evaluate.

    python -m bench contribution [--typical 200] [--megabyte 4] [--seed 7]

One server, the real model preloaded, the embedding memo off (KP_EMBED_MEMO_CAPACITY=0: the
second route's text would otherwise skip the model) and every request a dry run (the memory
stays as it is, so both routes meet the same one). The routes take turns trace by trace, the
first one rotating, so that a busy host slows all alike. Targets: typical traces'
/contribution p50 at most 1.10x /evaluate's; on a megabyte trace, the gate's own work
(app.contribution.capture.prepare, its CPU time in this process) at most a full-window
/evaluate's p50 (what the model costs for a text that fills its 512-token window). What
/contribution adds to /evaluate's p50 on the same megabyte traces is shown too: few samples
of large requests, it is the noisiest figure on a busy host.
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

import orjson

from app.contribution.capture import prepare
from bench import corpus, load
from bench.corpus import Item
from bench.server import Server
from bench.stats import latency_summary

ROUTES = ("/evaluate", "/contribution")
TYPICAL_TARGET = 1.10


def _requests(items: list[Item], route: str, port: int) -> list[bytes]:
    return [
        load.request_bytes("POST", f"{route}?dry_run=true", port, orjson.dumps(i.trace))
        for i in items
    ]


async def _side_by_side(
    port: int, items: list[Item], routes: tuple[str, ...]
) -> dict[str, list[float]]:
    """Each trace through each route, in turns; the ms of each answer, by route."""
    prepared = {route: _requests(items, route, port) for route in routes}
    conn = await load.Connection.open(port)
    try:
        for route in routes:  # warm-up: each route once
            status, _ = await conn.exchange(prepared[route][0])
            assert status == 200, (route, status)
        times: dict[str, list[float]] = {route: [] for route in routes}
        for i in range(len(items)):
            order = routes if i % 2 == 0 else routes[::-1]
            for route in order:
                started = time.perf_counter()
                status, body = await conn.exchange(prepared[route][i])
                times[route].append((time.perf_counter() - started) * 1000)
                if status != 200:
                    raise RuntimeError(f"{route}: {status} {body[:300]!r}")
        return times
    finally:
        await conn.close()


async def _turns(port: int, sends: dict[str, tuple[list[Item], str]]) -> dict[str, list[float]]:
    """Each named list through its route, one request of each in turn (the order rotating);
    the ms of each answer, by name."""
    requests = {name: _requests(items, route, port) for name, (items, route) in sends.items()}
    names = list(requests)
    conn = await load.Connection.open(port)
    try:
        for name in names:  # warm-up
            await conn.exchange(requests[name][0])
        times: dict[str, list[float]] = {name: [] for name in names}
        for i in range(min(len(r) for r in requests.values())):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                started = time.perf_counter()
                status, body = await conn.exchange(requests[name][i])
                times[name].append((time.perf_counter() - started) * 1000)
                if status != 200:
                    raise RuntimeError(f"{name}: {status} {body[:300]!r}")
        return times
    finally:
        await conn.close()


def _against_full_window(
    port: int, items: list[Item], full_window: list[Item]
) -> dict[str, list[float]]:
    sends = {
        "contribution": (items, "/contribution"),
        "evaluate": (items, "/evaluate"),
        "full_window": (full_window, "/evaluate"),
    }
    return load.run(lambda: _turns(port, sends))


def _gate_ms(items: list[Item]) -> float:
    """The median in-process time of the gate's text work (cleaning, findings, classifier)."""
    times = []
    for item in items:
        started = time.process_time()
        prepare(item.trace, quality_score=0.5)
        times.append((time.process_time() - started) * 1000)
    return statistics.median(times)


def run(typical: int, megabytes: int, seed: int) -> dict[str, Any]:
    typical_items = corpus.build("typical", typical, seed)
    full_window = corpus.build("long", max(megabytes, 2), seed)
    huge = {kind: corpus.megabyte(kind, megabytes, seed) for kind in corpus.MEGABYTE_KINDS}
    settings = {
        "KP_EMBEDDER_PRELOAD": "true",
        "KP_EMBED_MEMO_CAPACITY": "0",
        "KP_LOG_LEVEL": "warning",
    }
    with tempfile.TemporaryDirectory() as tmp, Server(settings, Path(tmp) / "server.log") as s:
        same = load.run(lambda: _side_by_side(s.port, typical_items, ROUTES))
        window = {
            kind: _against_full_window(s.port, items, full_window) for kind, items in huge.items()
        }
    evaluate, contribute = (latency_summary(same[r]) for r in ROUTES)
    ratio = contribute["p50_ms"] / evaluate["p50_ms"]
    megabyte_figures = {}
    for kind, times in window.items():
        contribution, evaluate_mb, full = (
            latency_summary(times[name])["p50_ms"]
            for name in ("contribution", "evaluate", "full_window")
        )
        gate = _gate_ms(huge[kind])
        megabyte_figures[kind] = {
            "contribution_p50_ms": contribution,
            "evaluate_p50_ms": evaluate_mb,
            "full_window_evaluate_p50_ms": full,
            "added_ms": contribution - evaluate_mb,
            "added_over_full_window": (contribution - evaluate_mb) / full,
            "contribution_over_full_window": contribution / full,
            "gate_cpu_ms": gate,
            "gate_cpu_over_full_window": gate / full,
            "body_bytes": statistics.median(len(orjson.dumps(i.trace)) for i in huge[kind]),
        }
    return {
        "typical": {
            "n": typical,
            "evaluate": evaluate,
            "contribution": contribute,
            "ratio_p50": ratio,
            "target": TYPICAL_TARGET,
            "pass": ratio <= TYPICAL_TARGET,
            "gate_cpu_ms": _gate_ms(typical_items),
        },
        "megabyte": {
            **megabyte_figures,
            "pass": all(f["gate_cpu_over_full_window"] <= 1.0 for f in megabyte_figures.values()),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench contribution", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--typical", type=int, default=200, help="typical traces (each twice)")
    parser.add_argument("--megabyte", type=int, default=4, help="megabyte traces of each kind")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    print(json.dumps(run(args.typical, args.megabyte, args.seed), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
