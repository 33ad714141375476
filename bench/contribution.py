"""What POST /contribution costs over POST /evaluate (docs/contribution.md): the same traces
sent to both routes, side by side, on one server; and megabyte traces through /contribution
against full-window traces through /evaluate.

    python -m bench contribution [--typical 200] [--megabyte 4] [--seed 7] [--out FILE]

One server, the real model preloaded, the embedding memo off (KP_EMBED_MEMO_CAPACITY=0: the
second route's text would otherwise skip the model) and every request a dry run (the memory
stays as it is, so both routes meet the same one). The routes take turns trace by trace, the
first one rotating, so that a busy host slows all alike. Targets: typical traces'
/contribution p50 at most 1.15x /evaluate's (the gate: the SDK's cleaning, the leak detectors,
the injection classifier, the larger answer); on a megabyte trace, the detectors' cost linear
in its size (8x the text, under 12x the CPU time: each string the join of eight traces'). The
gate's own work on a megabyte trace (app.contribution.capture.prepare, its CPU time in this
process) is shown against a full-window /evaluate's p50 (what the model costs for a text that
fills its 512-token window), and what /contribution adds to /evaluate's p50 on the same
megabyte traces: few samples of large requests, it is the noisiest figure on a busy host.
The figures go to bench/results/contribution.json (the performance page renders them).
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
from app.contribution.detectors import detect
from bench import corpus, load
from bench.corpus import Item
from bench.machine import machine, provenance
from bench.server import Server
from bench.stats import latency_summary

ROUTES = ("/evaluate", "/contribution")
TYPICAL_TARGET = 1.15
LINEAR_TARGET = 12.0
SCALE = 8
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "contribution.json"


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


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [t for k, v in value.items() for t in (k, *_strings(v))]
    if isinstance(value, list):
        return [t for v in value for t in _strings(v)]
    return []


def _detect_ms(texts: list[str]) -> float:
    best = float("inf")
    for _ in range(3):
        started = time.process_time()
        detect(texts)
        best = min(best, time.process_time() - started)
    return best * 1000


def _linear(kind: str, seed: int) -> dict[str, Any]:
    """The detectors' CPU time on a megabyte trace's strings and on strings eight times as
    long (each the join of eight traces' strings)."""
    items = corpus.megabyte(kind, SCALE, seed)
    columns = [_strings(item.trace) for item in items]
    one = _detect_ms(columns[0])
    large = [" ".join(parts) for parts in zip(*columns, strict=False)]
    scaled = _detect_ms(large)
    return {
        "chars": sum(map(len, columns[0])),
        "cpu_ms": one,
        "scaled_chars": sum(map(len, large)),
        "scaled_cpu_ms": scaled,
        "ratio": scaled / one,
        "target": LINEAR_TARGET,
        "pass": scaled / one < LINEAR_TARGET,
    }


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
    linear = {kind: _linear(kind, seed) for kind in corpus.MEGABYTE_KINDS}
    return {
        "run": provenance(),
        "machine": machine(),
        "typical": {
            "n": typical,
            "evaluate": evaluate,
            "contribution": contribute,
            "ratio_p50": ratio,
            "target": TYPICAL_TARGET,
            "pass": ratio <= TYPICAL_TARGET,
            "gate_cpu_ms": _gate_ms(typical_items),
        },
        "megabyte": megabyte_figures,
        "detectors_linear": {**linear, "pass": all(f["pass"] for f in linear.values())},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench contribution", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--typical", type=int, default=200, help="typical traces (each twice)")
    parser.add_argument("--megabyte", type=int, default=4, help="megabyte traces of each kind")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="default: %(default)s")
    args = parser.parse_args(argv)
    result = run(args.typical, args.megabyte, args.seed)
    text = json.dumps(result, indent=2)
    args.out.write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
