"""Where a lone client's request spends its time, part by part, on a preloaded service.

    python -m bench.profile_request [--quick] [--rounds N] [--out bench/results/profile_request.json]

The same typical traces go, one at a time and taking turns request by request, through five
nested paths, each the one before it plus one layer; the differences are each layer's cost:

1. model: tokenize, run, pool, normalise in the calling thread (OnnxEmbedder.embed);
2. queue: EmbeddingService.embed from the event loop: (1) on a worker thread, plus the queue
   hand-off, the worker's wake-up and the loop's wake-up when the vectors come back;
3. evaluator: Evaluator.evaluate on a parsed trace: (2) plus the novelty memory and scoring;
4. ASGI: the whole app called in process with the request's bytes (no socket): (3) plus the
   middleware (body limits, metrics, the access log line), routing, JSON parsing, validation
   and the response's serialisation;
5. HTTP: a real `python -m app.serve` (preloaded, as a user runs it) over loopback from the
   bench's lean client: (4) plus the socket, HTTP parsing, uvicorn and the client.

Paths 1-4 run in this process on its event loop; 5 is a server process of its own (started
before, idle while the others run). Then cProfile records the event-loop thread over the
ASGI path (4) alone, the top functions by their own time written to the results. All figures
are p50s over the rounds' requests; only differences measured in the same run mean much on a
shared machine. Taking turns request by request inflates "http - asgi": the model's threads
of this process may still spin on the cores when the server's turn comes.

Then the server alone, as a lone client meets it (this process idle between requests), split
by the server's own metrics: the model run (kp_embed_run_seconds), the wait for it
(kp_embed_queue_wait_seconds), the rest of the app around it (kp_http_request_duration_seconds
less both: middleware, parsing, validation, tokenising, hand-offs, scoring, the memory), and
what lies outside the app (the client's time less the app's: socket, HTTP parsing, uvicorn,
the client). Means over the requests.

Last, the app alone: path 4 with the model's run answered from memory (vectors the real model
made for the same texts), the event loop's CPU per request in blocks. Without onnxruntime's
threads beside the loop this is the app's own work (middleware, FastAPI, validation, the
novelty memory at up to 1,000 entries, scoring, serialisation, the queue's hand-offs), steady
enough to compare two versions of the code run one after the other.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import http.client
import io
import itertools
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import MutableMapping
from functools import partial
from pathlib import Path
from typing import Any

import orjson

from bench import corpus, load
from bench.server import HOST, ROOT, Server, cpu_seconds
from bench.stats import percentile

PATHS = ("model", "queue", "evaluator", "asgi", "http")


class InProcess:
    """The app of app.main built from settings with the model preloaded, driven by hand."""

    def __init__(self) -> None:
        os.environ["KP_EMBEDDER_PRELOAD"] = "true"
        # The paths send the same texts in turn: with the memo only the first would run the model.
        os.environ["KP_EMBED_MEMO_CAPACITY"] = "0"
        os.environ.setdefault("KP_LOG_LEVEL", "info")
        from app.core.config import Settings
        from app.core.logging import configure_logging
        from app.main import create_app

        settings = Settings.from_env()
        configure_logging(settings.log_level)
        # The access log goes where a server's goes, not onto this terminal.
        import logging

        sink = logging.StreamHandler(open(os.devnull, "w"))  # noqa: SIM115 - for the process's life
        for name in ("app", "uvicorn", "uvicorn.error"):
            logging.getLogger(name).handlers[:] = [sink]
        self.app = create_app(settings)
        self._lifespan = self.app.router.lifespan_context(self.app)

    async def __aenter__(self) -> InProcess:
        await self._lifespan.__aenter__()
        services = self.app.state.services
        self.services = services
        self.embedder = services.embeddings.lifecycle.embedder
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._lifespan.__aexit__(None, None, None)

    async def asgi(self, body: bytes) -> bytes:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/evaluate",
            "raw_path": b"/evaluate",
            "root_path": "",
            "query_string": b"",
            "headers": [
                (b"host", b"127.0.0.1"),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 8000),
            "app": self.app,
        }
        sent = False
        chunks: list[bytes] = []
        status = 0

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if sent:
                await asyncio.sleep(3600)
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: MutableMapping[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(scope, receive, send)
        if status != 200:
            raise RuntimeError(f"in-process POST /evaluate answered {status}: {chunks!r}")
        return b"".join(chunks)


async def _timed(step: Any) -> tuple[float, float]:
    """Milliseconds of `step()` (awaited when it returns an awaitable): on the clock, and of
    this thread's CPU (the event loop's: what other threads do for it is not in it)."""
    cpu = time.thread_time()
    started = time.perf_counter()
    result = step()
    if asyncio.iscoroutine(result):
        await result
    return (time.perf_counter() - started) * 1000, (time.thread_time() - cpu) * 1000


async def measure(
    items: list[corpus.Item], rounds: int, port: int, pid: int
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, float]]:
    """Per path: wall milliseconds and event-loop CPU milliseconds of each request; and the
    HTTP server's CPU per request (all its threads, and its event loop's alone)."""
    from app.schemas.trace import ReasoningTrace

    bodies = [orjson.dumps(i.trace) for i in items]
    http_requests = load.evaluate_requests([i.trace for i in items], port)
    traces = [ReasoningTrace.model_validate(i.trace) for i in items]
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    cpu: dict[str, list[float]] = {p: [] for p in PATHS}
    server_cpu = {"process": 0.0, "event_loop": 0.0}
    async with InProcess() as app:
        service, evaluator, embedder = app.services.embeddings, app.services.evaluator, app.embedder
        conn = await load.Connection.open(port)
        for r in range(rounds):
            await load.reset_cache(port)
            for i, (item, trace, body, request) in enumerate(
                zip(items, traces, bodies, http_requests, strict=True)
            ):
                steps = {
                    "model": partial(embedder.embed, [item.text]),
                    "queue": partial(service.embed, [item.text]),
                    "evaluator": partial(evaluator.evaluate, [trace], dry_run=True),
                    "asgi": partial(app.asgi, body),
                    "http": partial(conn.exchange, request),
                }
                order = list(PATHS)
                shift = (i + r) % len(order)
                for name in order[shift:] + order[:shift]:
                    if name == "http":
                        before = cpu_seconds(pid), cpu_seconds(pid, main_thread_only=True)
                    wall, loop_cpu = await _timed(steps[name])
                    if name == "http":
                        server_cpu["process"] += cpu_seconds(pid) - before[0]
                        server_cpu["event_loop"] += (
                            cpu_seconds(pid, main_thread_only=True) - before[1]
                        )
                    times[name].append(wall)
                    cpu[name].append(loop_cpu)
        await conn.close()
    count = len(times["http"])
    return times, cpu, {k: 1000 * v / count for k, v in server_cpu.items()}


def _histogram_totals(port: int) -> dict[str, tuple[float, float]]:
    """(sum, count) of the histograms the server split uses, from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection(HOST, port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    wanted = {
        "kp_embed_run_seconds": {},
        "kp_embed_queue_wait_seconds": {},
        "kp_http_request_duration_seconds": {"route": "/evaluate"},
    }
    totals: dict[str, tuple[float, float]] = {}
    for family in text_string_to_metric_families(text):
        labels = wanted.get(family.name)
        if labels is None:
            continue
        found = {
            sample.name.removeprefix(family.name): sample.value
            for sample in family.samples
            if sample.name.endswith(("_sum", "_count")) and labels.items() <= sample.labels.items()
        }
        totals[family.name] = (found.get("_sum", 0.0), found.get("_count", 0.0))
    return totals


async def server_split(items: list[corpus.Item], rounds: int, port: int) -> dict[str, float]:
    """Mean ms per request of the lone client's time, split by the server's own metrics."""
    requests = load.evaluate_requests([i.trace for i in items], port)
    client_ms: list[float] = []
    before = _histogram_totals(port)
    for _ in range(rounds):
        await load.reset_cache(port)
        client_ms += (await load.closed_loop(port, requests, 1)).latencies_ms
    after = _histogram_totals(port)

    def mean_ms(name: str) -> float:
        total = after[name][0] - before[name][0]
        count = after[name][1] - before[name][1]
        return 1000 * total / count if count else float("nan")

    client, app = statistics.fmean(client_ms), mean_ms("kp_http_request_duration_seconds")
    run, wait = mean_ms("kp_embed_run_seconds"), mean_ms("kp_embed_queue_wait_seconds")
    return {
        "client": client,
        "outside the app": client - app,
        "app around the model": app - run - wait,
        "queue wait": wait,
        "model run": run,
    }


async def app_alone(items: list[corpus.Item], blocks: int, repeat: int) -> list[float]:
    """Event-loop CPU ms per request over the ASGI path (4) with the model's run answered
    from memory (the vectors the real model made for these texts, first): the app's own work
    and the queue's hand-offs, without onnxruntime's threads beside the loop, which inflate
    path 4's figure on a 2-core host. One mean per block of `repeat` x the traces."""
    bodies = [orjson.dumps(i.trace) for i in items]
    async with InProcess() as app:
        scheduler = app.services.embeddings.scheduler
        known = {i.text: e for i in items for e in scheduler.backend([i.text], False)}
        scheduler.backend = lambda texts, one_core: [known[t] for t in texts]
        # The memory filled to its capacity first: the scan then costs what it costs in use.
        for _ in range(-(-app.services.settings.cache_capacity // len(bodies))):
            for body in bodies:
                await app.asgi(body)
        means = []
        for _ in range(blocks):
            cpu = time.thread_time()
            for _ in range(repeat):
                for body in bodies:
                    await app.asgi(body)
            means.append(1000 * (time.thread_time() - cpu) / (repeat * len(bodies)))
    return means


async def profile(items: list[corpus.Item], repeat: int) -> str:
    """cProfile of this (event-loop) thread over the ASGI path."""
    bodies = [orjson.dumps(i.trace) for i in items]
    async with InProcess() as app:
        for body in bodies[:10]:
            await app.asgi(body)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(repeat):
            for body in bodies:
                await app.asgi(body)
        profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(30)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_request", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "profile_request.json"
    )
    args = parser.parse_args(argv)
    items = corpus.build("typical", 30 if args.quick else 80, seed=51)
    tmp = Path(tempfile.mkdtemp(prefix="kp-profile-"))
    with Server(
        {"KP_EMBEDDER_PRELOAD": "true", "KP_EMBED_MEMO_CAPACITY": "0"}, tmp / "server.log"
    ) as server:
        times, cpu, server_cpu = load.run(
            lambda: measure(items, args.rounds, server.port, server.pid)
        )
        split = load.run(lambda: server_split(items, args.rounds, server.port))
    p50 = {name: percentile(ms, 50) for name, ms in times.items()}
    loop_cpu = {name: statistics.fmean(ms) for name, ms in cpu.items() if name != "http"}
    # Per request, each layer's own cost: the difference to the path inside it, request by
    # request, then the median (steadier than a difference of medians).
    layers = {
        f"{outer} - {inner}": statistics.median(
            a - b for a, b in zip(times[outer], times[inner], strict=True)
        )
        for inner, outer in itertools.pairwise(PATHS)
    }
    alone = load.run(lambda: app_alone(items, 5, 4 if args.quick else 10))
    profile_text = load.run(lambda: profile(items, 2 if args.quick else 5))
    doc = {
        "requests_per_path": len(times["model"]),
        "p50_ms": p50,
        "layer_p50_ms": layers,
        "event_loop_cpu_mean_ms": loop_cpu,
        "http_server_cpu_per_request_ms": server_cpu,
        "lone_client_split_mean_ms": split,
        "app_alone_event_loop_cpu_ms": alone,
        "profile_asgi_tottime": profile_text.splitlines(),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"{len(times['model'])} typical requests per path, p50 ms:")
    for name in PATHS:
        print(f"  {name:10s} {p50[name]:8.3f}")
    print("each layer's own cost (median of per-request differences), ms:")
    for name, ms in layers.items():
        print(f"  {name:22s} {ms:8.3f}")
    print(
        "event-loop CPU per request (this process; the model runs on a worker from 'queue' on), ms:"
    )
    for name, ms in loop_cpu.items():
        print(f"  {name:10s} {ms:8.3f}")
    print(
        f"HTTP server CPU per request: {server_cpu['process']:.3f} ms, of which its event loop "
        f"{server_cpu['event_loop']:.3f} ms (clock ticks of /proc, summed over the requests)"
    )
    print("a lone client's request on the server alone, by its own metrics (means), ms:")
    for name, ms in split.items():
        print(f"  {name:22s} {ms:8.3f}")
    print(
        "the app alone (ASGI path, the model's run answered from memory), event-loop CPU per "
        f"request, ms: median {statistics.median(alone):.3f} of {len(alone)} blocks "
        f"({min(alone):.3f}-{max(alone):.3f})"
    )
    print(profile_text[:6000], file=sys.stderr)
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
