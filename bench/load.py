"""The load generator: closed-loop clients on keep-alive HTTP/1.1 connections, in asyncio.

The client is deliberately lean (requests serialised before the clock starts, a minimal
HTTP/1.1 exchange on asyncio streams with uvloop, responses parsed after the
phase) because it runs on the same cores as the server: every microsecond it spends is one
the server does not get. httpx costs several times more CPU per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import orjson

from bench.server import ADMIN_TOKEN, HOST, cpu_seconds

T = TypeVar("T")


def run(factory: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine on a fresh event loop (uvloop's when installed)."""
    try:
        import uvloop

        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is optional here
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(_call(factory))


async def _call(factory: Callable[[], Awaitable[T]]) -> T:
    return await factory()


def request_bytes(
    method: str, path: str, port: int, body: bytes = b"", admin: bool = False
) -> bytes:
    """One complete HTTP/1.1 request, ready to write."""
    head = [f"{method} {path} HTTP/1.1", f"Host: {HOST}:{port}", "User-Agent: kp-bench"]
    if body or method in ("POST", "PUT"):
        head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    if admin:
        head.append(f"Authorization: Bearer {ADMIN_TOKEN}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def evaluate_requests(traces: list[dict[str, Any]], port: int) -> list[bytes]:
    return [request_bytes("POST", "/evaluate", port, orjson.dumps(t)) for t in traces]


class Connection:
    """One keep-alive connection; one request at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, port: int) -> Connection:
        reader, writer = await asyncio.open_connection(HOST, port)
        return cls(reader, writer)

    async def exchange(self, request: bytes) -> tuple[int, bytes]:
        self._writer.write(request)
        head = await self._reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lower = head.lower()
        at = lower.find(b"\r\ncontent-length:")
        if at < 0:
            raise RuntimeError(f"response without Content-Length: {head[:200]!r}")
        end = lower.index(b"\r\n", at + 2)
        body = await self._reader.readexactly(int(lower[at + 17 : end]))
        return status, body

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()


async def call(port: int, request: bytes) -> tuple[int, bytes, float]:
    """One request on a new connection: status, body and milliseconds (connection excluded)."""
    conn = await Connection.open(port)
    try:
        started = time.perf_counter()
        status, body = await conn.exchange(request)
        return status, body, (time.perf_counter() - started) * 1000
    finally:
        await conn.close()


async def histogram_totals(port: int, name: str) -> tuple[float, float]:
    """A histogram's (sum, count) from the service's /metrics."""
    status, body, _ = await call(port, request_bytes("GET", "/metrics", port))
    if status != 200:
        raise RuntimeError(f"GET /metrics answered {status}: {body[:300]!r}")
    totals = {}
    for line in body.decode().splitlines():
        key, _, value = line.partition(" ")
        if key in (f"{name}_sum", f"{name}_count"):
            totals[key] = float(value)
    return totals[f"{name}_sum"], totals[f"{name}_count"]


async def reset_cache(port: int) -> None:
    status, body, _ = await call(port, request_bytes("DELETE", "/cache", port, admin=True))
    if status != 200:
        raise RuntimeError(f"DELETE /cache answered {status}: {body[:300]!r}")


@dataclass
class Phase:
    """What one closed-loop phase measured."""

    clients: int
    latencies_ms: list[float] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    #: Latencies of the 503 answers (the service's overload guard), not in `latencies_ms`.
    turned_away_ms: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0
    server_cpu_s: float = float("nan")
    event_loop_cpu_s: float = float("nan")  # the server's main thread, part of server_cpu_s
    client_cpu_s: float = 0.0

    @property
    def count(self) -> int:
        return len(self.latencies_ms)

    @property
    def throughput_rps(self) -> float:
        return self.count / self.elapsed_s

    def responses(self) -> list[dict[str, Any]]:
        return [orjson.loads(b) for b in self.bodies]


async def closed_loop(
    port: int,
    requests: list[bytes],
    clients: int,
    *,
    max_seconds: float = 60.0,
    server_pid: int | None = None,
    retry_after_s: float = 1.0,
) -> Phase:
    """`clients` connections, each sending its next request as soon as its last one returns,
    until the requests are used up or `max_seconds` have passed. A 503 is counted and its
    client waits for Retry-After, as a well-behaved client does; any other non-200 fails."""
    phase = Phase(clients)
    connections = [await Connection.open(port) for _ in range(clients)]
    queue: Iterator[bytes] = iter(requests)
    failures: list[str] = []
    deadline = time.perf_counter() + max_seconds

    last_answer = time.perf_counter()

    async def client(conn: Connection) -> None:
        nonlocal last_answer
        for request in queue:
            started = time.perf_counter()
            status, body = await conn.exchange(request)
            finished = last_answer = time.perf_counter()
            if status == 503:
                phase.turned_away_ms.append((finished - started) * 1000)
                await asyncio.sleep(retry_after_s)
                continue
            if status != 200:
                failures.append(f"{status}: {body[:300]!r}")
                return
            phase.latencies_ms.append((finished - started) * 1000)
            phase.bodies.append(body)
            if finished > deadline:
                return

    cpu_before = cpu_seconds(server_pid) if server_pid else 0.0
    loop_before = cpu_seconds(server_pid, main_thread_only=True) if server_pid else 0.0
    client_cpu = time.process_time()
    started = time.perf_counter()
    await asyncio.gather(*(client(c) for c in connections))
    # Up to the last answer: a client turned away near the end sleeps Retry-After and then
    # finds no request left; that idle second is not the service's.
    phase.elapsed_s = last_answer - started
    phase.client_cpu_s = time.process_time() - client_cpu
    if server_pid:
        phase.server_cpu_s = cpu_seconds(server_pid) - cpu_before
        phase.event_loop_cpu_s = cpu_seconds(server_pid, main_thread_only=True) - loop_before
    for c in connections:
        await c.close()
    if failures:
        raise RuntimeError(f"{len(failures)} requests failed, first: {failures[0]}")
    return phase


@dataclass
class OpenLoop:
    """What an open-loop phase measured: requests sent on a schedule, whatever the answers."""

    offered_rps: float
    latencies_ms: list[float] = field(default_factory=list)
    turned_away: int = 0
    elapsed_s: float = 0.0

    @property
    def achieved_rps(self) -> float:
        return len(self.latencies_ms) / self.elapsed_s


async def open_loop(
    port: int, requests: list[bytes], rate_rps: float, *, seed: int = 0
) -> OpenLoop:
    """Sends `requests` at Poisson arrivals of `rate_rps` (seeded), each on a free keep-alive
    connection (a new one when all are busy), as independent clients arrive: a slow answer
    does not delay the next arrival. A 503 is counted; any other non-200 fails."""
    phase = OpenLoop(rate_rps)
    gaps = np.random.default_rng(seed).exponential(1 / rate_rps, len(requests))
    idle: list[Connection] = []
    failures: list[str] = []

    async def one(request: bytes) -> None:
        conn = idle.pop() if idle else await Connection.open(port)
        started = time.perf_counter()
        try:
            status, body = await conn.exchange(request)
        except (asyncio.IncompleteReadError, ConnectionError):
            # A connection idle past the server's keep-alive timeout was closed: as a client
            # would, send again on a new one (the time counts from the first attempt).
            await conn.close()
            conn = await Connection.open(port)
            status, body = await conn.exchange(request)
        elapsed_ms = (time.perf_counter() - started) * 1000
        idle.append(conn)
        if status == 503:
            phase.turned_away += 1
        elif status != 200:
            failures.append(f"{status}: {body[:300]!r}")
        else:
            phase.latencies_ms.append(elapsed_ms)

    started = time.perf_counter()
    due = started
    tasks = []
    for request, gap in zip(requests, gaps, strict=True):
        due += float(gap)
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        tasks.append(asyncio.create_task(one(request)))
    await asyncio.gather(*tasks)
    phase.elapsed_s = time.perf_counter() - started
    for c in idle:
        await c.close()
    if failures:
        raise RuntimeError(f"{len(failures)} requests failed, first: {failures[0]}")
    return phase
