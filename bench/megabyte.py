"""Megabyte traces (issue 15): one client sending each kind side by side with full-window
traces, then /healthz answered while four clients send megabyte traces.

One server (preloaded, the run's settings). The single client interleaves the kinds request by
request (a full-window trace, then one of each megabyte kind, and again), so that every kind
meets the same machine; the ratio is each kind's p50 over the full-window p50. The probe sends
GET /healthz every 10 ms on a connection of its own while four closed-loop clients send the
megabyte kinds in turn; the same probe on the idle server gives its baseline.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from pathlib import Path
from typing import Any

import orjson

from bench import load
from bench.corpus import Item
from bench.server import Server
from bench.stats import latency_summary, percentile

PROBE_INTERVAL_S = 0.01
LOAD_CLIENTS = 4


def measure(
    env: dict[str, str],
    log: Path,
    full_window: list[Item],
    megabyte: dict[str, list[Item]],
    load_seconds: float,
) -> dict[str, Any]:
    kinds = {"full_window": full_window, **megabyte}
    with Server({"KP_EMBEDDER_PRELOAD": "true", **env}, log) as server:
        port, pid = server.port, server.pid
        requests = {k: load.evaluate_requests([i.trace for i in v], port) for k, v in kinds.items()}

        async def sequence() -> dict[str, Any]:
            conn = await load.Connection.open(port)
            for kind in kinds:  # warm-up: one of each
                await _exchange(conn, requests[kind][0])
            await load.reset_cache(port)
            latencies: dict[str, list[float]] = {kind: [] for kind in kinds}
            answers: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
            for i in range(min(len(r) for r in requests.values())):
                for kind in kinds:
                    started = time.perf_counter()
                    body = await _exchange(conn, requests[kind][i])
                    latencies[kind].append((time.perf_counter() - started) * 1000)
                    answers[kind].append(orjson.loads(body))
            await conn.close()
            single = {kind: _single_figures(latencies[kind], answers[kind]) for kind in kinds}
            for kind, items in megabyte.items():
                single[kind]["body_bytes"] = statistics.median(
                    len(orjson.dumps(i.trace)) for i in items
                )
            idle = await _probe_healthz(port, asyncio.Event(), count=200)
            mixed = [
                r for group in zip(*(requests[k] for k in megabyte), strict=True) for r in group
            ]
            stop = asyncio.Event()
            probe = asyncio.create_task(_probe_healthz(port, stop))
            phase = await load.closed_loop(
                port,
                list(itertools.islice(itertools.cycle(mixed), 100_000)),
                LOAD_CLIENTS,
                max_seconds=load_seconds,
                server_pid=pid,
            )
            stop.set()
            probes = await probe
            away = phase.turned_away_ms
            return {
                "single_client": single,
                "healthz_idle": _healthz_figures(idle),
                "under_load": {
                    **latency_summary(phase.latencies_ms),
                    "clients": LOAD_CLIENTS,
                    "throughput_rps": phase.throughput_rps,
                    "turned_away": len(away),
                    "turned_away_share": len(away) / (len(away) + phase.count),
                    "turned_away_p99_ms": percentile(away, 99) if away else 0.0,
                    "server_cpu_ms_per_request": phase.server_cpu_s * 1000 / phase.count,
                    "event_loop_cpu_ms_per_request": phase.event_loop_cpu_s * 1000 / phase.count,
                    "healthz": _healthz_figures(probes),
                },
            }

        return load.run(sequence)


async def _exchange(conn: load.Connection, request: bytes) -> bytes:
    status, body = await conn.exchange(request)
    if status != 200:
        raise RuntimeError(f"POST /evaluate answered {status}: {body[:300]!r}")
    return body


def _single_figures(latencies: list[float], answers: list[dict[str, Any]]) -> dict[str, Any]:
    windows = {(a["novelty"]["tokens"], a["novelty"]["truncated"]) for a in answers}
    if windows != {(512, True)}:
        raise RuntimeError(f"expected full windows of 512 tokens, the service read {windows}")
    return {
        **latency_summary(latencies),
        "service_elapsed_p50_ms": percentile([a["elapsed_ms"] for a in answers], 50),
    }


async def _probe_healthz(port: int, stop: asyncio.Event, count: int = 0) -> list[float]:
    """GET /healthz every PROBE_INTERVAL_S until `stop` (or `count` probes): milliseconds."""
    conn = await load.Connection.open(port)
    request = load.request_bytes("GET", "/healthz", port)
    times: list[float] = []
    while not stop.is_set() and (not count or len(times) < count):
        started = time.perf_counter()
        status, body = await conn.exchange(request)
        if status != 200:
            raise RuntimeError(f"GET /healthz answered {status}: {body[:300]!r}")
        times.append((time.perf_counter() - started) * 1000)
        await asyncio.sleep(PROBE_INTERVAL_S)
    await conn.close()
    return times


def _healthz_figures(times: list[float]) -> dict[str, float]:
    return {
        "n": len(times),
        "p50_ms": percentile(times, 50),
        "p99_ms": percentile(times, 99),
        "max_ms": max(times),
    }
