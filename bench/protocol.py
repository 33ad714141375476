"""The HTTP protocol's cost: uvicorn's httptools protocol against the one with bounds
(app/server/protocol.py).

    python -m bench.protocol [--requests N] [--rounds N]
    python -m bench.protocol --service none|model [--rounds N] [--seconds S]

By default in process: no sockets and no FastAPI, a trivial ASGI app behind each protocol,
fed requests on one kept-alive connection through an in-memory transport, so what differs is
the protocol alone (timers, header counting, the Host check); microseconds per request on
uvloop (uvicorn's loop when installed).

With --service: two services side by side, one with each protocol (`none`: KP_EMBEDDER=none,
the HTTP path alone; `model`: the real model, preloaded), measured as the bench measures
(closed loop, 1 and 16 clients): throughput, median latency and the server's CPU per request.

Rounds alternate the two, so a busy machine slows both alike; figures are medians over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import uvloop
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from app.server.protocol import LimitedHttpToolsProtocol
from bench import corpus, load
from bench.corpus import Item
from bench.load import Phase
from bench.server import SERVE, Server
from bench.stats import percentile

Message = MutableMapping[str, Any]

BODY = b'{"id": "kp:trace:bench", "steps": [' + b'{"type": "thought"},' * 20 + b"{}]}"
REQUEST = (
    b"POST /evaluate HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nUser-Agent: bench/1.0\r\n"
    b"Accept: */*\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(BODY)
) + BODY


async def _app(
    scope: Message, receive: Callable[[], Awaitable[Message]], send: Callable[[Message], Any]
) -> None:
    while (await receive()).get("more_body"):
        pass
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
    )
    await send({"type": "http.response.body", "body": b"ok"})


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.answered = asyncio.Event()
        self.closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if bytes(data).endswith(b"ok"):  # the body: the answer is complete
            self.answered.set()

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(
            name, default
        )

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _run(protocol_class: type[HttpToolsProtocol], requests: int) -> float:
    """Microseconds per request through `protocol_class`."""
    config = Config(app=_app, lifespan="off", access_log=False, log_level="warning")
    config.load()
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
    transport = _Transport()
    protocol.connection_made(transport)
    started = time.perf_counter()
    for _ in range(requests):
        protocol.data_received(REQUEST)
        await transport.answered.wait()
        transport.answered.clear()
    elapsed = time.perf_counter() - started
    protocol.connection_lost(None)
    return elapsed / requests * 1e6


STOCK_NAME = "httptools (uvicorn)"
STOCK = (sys.executable, "-m", "uvicorn", "--factory", "app.main:create_app", "--http", "httptools")
COMMANDS = {STOCK_NAME: STOCK, "with bounds": SERVE}


def _service_phase(server: Server, items: list[Item], clients: int, seconds: float) -> Phase:
    bodies = load.evaluate_requests([i.trace for i in items], server.port)

    async def sequence() -> Phase:
        await load.reset_cache(server.port)
        await load.closed_loop(server.port, bodies[:32], clients)
        return await load.closed_loop(
            server.port, bodies * 40, clients, max_seconds=seconds, server_pid=server.pid
        )

    return load.run(sequence)


def services(mode: str, rounds: int, seconds: float) -> None:
    env = {"KP_EMBEDDER": "none"} if mode == "none" else {"KP_EMBEDDER_PRELOAD": "true"}
    items = corpus.build("typical", 400, seed=7)
    figures: dict[tuple[str, int], list[Phase]] = {
        (name, c): [] for name in COMMANDS for c in (1, 16)
    }
    with tempfile.TemporaryDirectory() as tmp:
        running = {
            name: Server(env, Path(tmp) / f"{i}.log", timeout_s=180, command=command)
            for i, (name, command) in enumerate(COMMANDS.items())
        }
        try:
            for r in range(rounds):
                names = list(running) if r % 2 == 0 else list(reversed(running))
                for clients in (1, 16):
                    for name in names:
                        phase = _service_phase(running[name], items, clients, seconds)
                        figures[(name, clients)].append(phase)
        finally:
            for server in running.values():
                server.stop()
    print(f"KP_EMBEDDER={'none' if mode == 'none' else 'onnx'}, {rounds} rounds of {seconds} s")
    for clients in (1, 16):
        base = statistics.median(p.throughput_rps for p in figures[(STOCK_NAME, clients)])
        for name in COMMANDS:
            phases = figures[(name, clients)]
            rps = statistics.median(p.throughput_rps for p in phases)
            p50 = statistics.median(percentile(p.latencies_ms, 50) for p in phases)
            cpu = statistics.median(p.server_cpu_s / p.count * 1e6 for p in phases)
            print(
                f"  {clients:>2} clients, {name:<20} {rps:8.1f} req/s ({rps / base:.3f}x; runs "
                f"{', '.join(f'{p.throughput_rps:.0f}' for p in phases)}), p50 {p50:.2f} ms, "
                f"server CPU {cpu:.0f} us/request"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--service", choices=("none", "model"))
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    if args.service:
        services(args.service, args.rounds, args.seconds)
        return
    classes: dict[str, type[HttpToolsProtocol]] = {
        STOCK_NAME: HttpToolsProtocol,
        "with bounds": LimitedHttpToolsProtocol,
    }
    runs: dict[str, list[float]] = {name: [] for name in classes}
    for r in range(args.rounds):
        names = list(classes) if r % 2 == 0 else list(reversed(classes))
        for name in names:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runs[name].append(runner.run(_run(classes[name], args.requests)))
    base = statistics.median(runs[STOCK_NAME])
    print(f"{args.requests} requests x {args.rounds} rounds, one kept-alive connection")
    for name, values in runs.items():
        median = statistics.median(values)
        print(
            f"  {name:<20} {median:6.2f} us/request (median; runs "
            f"{', '.join(f'{v:.2f}' for v in values)}), {median / base:.3f}x"
        )


if __name__ == "__main__":
    main()
