"""The HTTP protocol's own cost: uvicorn's httptools protocol against the one with bounds
(app/server/protocol.py), per request, on one kept-alive connection, in process.

    python -m bench.protocol [--requests N] [--rounds N]

No sockets and no FastAPI: a trivial ASGI app behind each protocol, fed requests through an
in-memory transport, so what differs is the protocol alone (timers, header counting, the Host
check). Rounds alternate the two, so a busy machine slows both alike; the figures are CPU-bound
microseconds per request, medians over rounds, on uvloop (uvicorn's loop when installed).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import uvloop
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from app.server.protocol import LimitedHttpToolsProtocol

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    classes: dict[str, type[HttpToolsProtocol]] = {
        "httptools (uvicorn)": HttpToolsProtocol,
        "with bounds": LimitedHttpToolsProtocol,
    }
    runs: dict[str, list[float]] = {name: [] for name in classes}
    for r in range(args.rounds):
        names = list(classes) if r % 2 == 0 else list(reversed(classes))
        for name in names:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runs[name].append(runner.run(_run(classes[name], args.requests)))
    base = statistics.median(runs["httptools (uvicorn)"])
    print(f"{args.requests} requests x {args.rounds} rounds, one kept-alive connection")
    for name, values in runs.items():
        median = statistics.median(values)
        print(
            f"  {name:<20} {median:6.2f} us/request (median; runs "
            f"{', '.join(f'{v:.2f}' for v in values)}), {median / base:.3f}x"
        )


if __name__ == "__main__":
    main()
