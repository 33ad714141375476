"""Refused bodies: a client that sends its whole body before it reads gets the 4xx, not a reset.

Against a live server with Python's urllib, which writes the whole request before it reads the
answer: the service must read and drop the rest of a refused body (within bounds) before it
answers and closes the connection, or the client sees "connection reset" instead of the 413.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.types import ASGIApp

from app.api.edge import DISCARD_BYTES, Admission, Edge
from app.core.config import Settings
from app.core.metrics import Metrics
from app.guards.api_keys import KeyRing
from tests.factories import make_trace
from tests.server import TOKEN, LiveServer
from tests.test_pipeline import service_over

MIB = 1024 * 1024
LIMIT = MIB  # KP_MAX_BODY_BYTES's default


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The real model, one trace cached: a refused request that changed state would show."""
    log = tmp_path_factory.mktemp("refused") / "server.log"
    env = {"KP_ADMIN_TOKEN": TOKEN, "KP_EMBEDDER_PRELOAD": "true", "KP_LOG_LEVEL": "info"}
    server = LiveServer(env, Path(log))
    assert server.post("/evaluate", make_trace()).status_code == 200
    yield server
    server.stop()


def _urllib_post(
    url: str, data: bytes | Iterable[bytes], headers: dict[str, str]
) -> tuple[int, dict[str, str], Any]:
    """POST as urllib does it: the whole body first, then the answer."""
    request = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return (
            error.code,
            {k.lower(): v for k, v in error.headers.items()},
            json.loads(error.read()),
        )


def _chunks(body: bytes, size: int = 64 * 1024) -> Iterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start : start + size]


def _state(server: LiveServer) -> tuple[Any, ...]:
    cache = server.client.get("/cache", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    metrics = server.client.get("/metrics").text
    scored = [line for line in metrics.splitlines() if line.startswith("kp_evaluations_total")]
    return cache["size"], cache["adds_total"], tuple(scored)


def _oversized(size: int) -> bytes:
    trace = json.dumps(make_trace(objective="x" * size)).encode()
    assert len(trace) > LIMIT
    return trace


@pytest.mark.parametrize("megabytes", [2, 8, 48])
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_urllib_gets_the_413_not_a_reset(live: LiveServer, megabytes: int, framing: str) -> None:
    before = _state(live)
    body = _oversized(megabytes * MIB)
    headers = {"Content-Type": "application/json"}
    if framing == "chunked":
        headers["Transfer-Encoding"] = "chunked"
    data = body if framing == "content-length" else _chunks(body)
    status, answer_headers, answer = _urllib_post(f"{live.url}/evaluate", data, headers)
    assert status == 413
    assert answer_headers["connection"] == "close"
    assert answer_headers["content-type"] == "application/json"
    assert answer == {
        "detail": [
            {
                "loc": ["body"],
                "msg": f"request body is larger than {LIMIT} bytes (KP_MAX_BODY_BYTES)",
                "type": "body_too_large",
            }
        ]
    }
    assert _state(live) == before


def test_urllib_gets_the_415_for_a_large_body_of_another_type(live: LiveServer) -> None:
    before = _state(live)
    headers = {"Content-Type": "text/plain"}
    status, _, answer = _urllib_post(f"{live.url}/evaluate", b"x" * (8 * MIB), headers)
    assert status == 415
    assert answer["detail"][0]["loc"] == ["header", "content-type"]
    assert _state(live) == before


def test_a_body_beyond_the_discard_bound_is_cut_off(live: LiveServer) -> None:
    """A body that never ends is dropped up to the bound, then the connection closes."""
    cap = 1024 * MIB  # what the client would send if the server read on and on
    sent = 0

    def endless() -> Iterator[bytes]:
        nonlocal sent
        chunk = b"x" * (64 * 1024)
        while sent < cap:
            sent += len(chunk)
            yield chunk

    headers = {"Content-Type": "application/json", "Transfer-Encoding": "chunked"}
    with pytest.raises(urllib.error.URLError) as cut:
        _urllib_post(f"{live.url}/evaluate", endless(), headers)
    assert isinstance(cut.value.reason, ConnectionError), cut.value
    # What the server read plus what the sockets' buffers hold (a few MiB on loopback).
    assert sent < LIMIT + DISCARD_BYTES + 64 * MIB, sent
    assert "refused body still coming at the discard bound" in live.log_path.read_text()
    assert live.client.get("/healthz").status_code == 200


def test_a_declared_length_beyond_the_discard_bound_is_not_read(live: LiveServer) -> None:
    declared = 4 * DISCARD_BYTES
    sent = 0

    def body() -> Iterator[bytes]:
        nonlocal sent
        chunk = b"x" * (64 * 1024)
        while sent < declared:
            sent += len(chunk)
            yield chunk

    headers = {"Content-Type": "application/json", "Content-Length": str(declared)}
    with pytest.raises(urllib.error.URLError) as cut:
        _urllib_post(f"{live.url}/evaluate", body(), headers)
    assert isinstance(cut.value.reason, ConnectionError), cut.value
    assert sent < DISCARD_BYTES, sent


def test_the_server_logged_no_error(live: LiveServer) -> None:
    """Runs after the tests above (same module server): no 500, no traceback."""
    headers = {"Content-Type": "application/json"}
    assert _urllib_post(f"{live.url}/evaluate", _chunks(_oversized(2 * MIB)), headers)[0] == 413
    metrics = live.client.get("/metrics").text
    assert 'kp_http_errors_total{route="unmatched",status="413"}' in metrics
    assert 'status="500"' not in metrics
    log = live.log_path.read_text(errors="replace")
    assert "Traceback" not in log
    assert '"status":500' not in log


# The guard on its own, with a scripted client: the bounds hold whatever the client does.

Receive = Callable[[], Awaitable[dict[str, Any]]]


def _guard(max_body_bytes: int, **bounds: Any) -> ASGIApp:
    """The pipeline's pieces that refuse bodies, as the service orders them."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("a refused request reached the app")

    admission = Admission(app, max_body_bytes=max_body_bytes, max_json_depth=32)
    edge = Edge(admission, metrics=Metrics(), body_timeout_s=3600, **bounds)
    state = SimpleNamespace(service=service_over(Settings(), KeyRing([])))

    async def with_app(scope: Any, receive: Any, send: Any) -> None:
        await edge({**scope, "app": SimpleNamespace(state=state)}, receive, send)

    return with_app


def _post(guard: ASGIApp, headers: dict[str, str], receive: Receive) -> list[dict[str, Any]]:
    """Runs a POST through the guard; returns the messages it sent."""
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/evaluate",
        "query_string": b"",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }
    asyncio.run(guard(scope, receive, send))
    return sent


class Client:
    """Sends `chunks` chunks of `size` bytes, then ends the body (or stalls first)."""

    def __init__(self, size: int, chunks: int, stall_s: float = 0) -> None:
        self.size, self.chunks, self.stall_s = size, chunks, stall_s
        self.reads = 0

    async def receive(self) -> dict[str, Any]:
        self.reads += 1
        if self.reads <= self.chunks:
            return {"type": "http.request", "body": b"x" * self.size, "more_body": True}
        await asyncio.sleep(self.stall_s)
        return {"type": "http.request", "body": b"", "more_body": False}


def _answer(sent: list[dict[str, Any]]) -> tuple[int, bytes, bool]:
    """Status, body, and whether it closes the connection; fails if the response never ends."""
    start, *bodies = sent
    assert bodies[-1].get("more_body", False) is False
    closes = (b"connection", b"close") in start["headers"]
    return start["status"], b"".join(m["body"] for m in bodies), closes


def test_guard_drops_a_body_that_ends_then_answers() -> None:
    client = Client(3000, 10)
    sent = _post(_guard(max_body_bytes=4096), {"content-type": "text/plain"}, client.receive)
    status, body, closes = _answer(sent)
    assert (status, closes) == (415, True)
    assert json.loads(body)["detail"][0]["type"] == "unsupported_media_type"
    assert client.reads == 11  # all of it, to the end


def test_guard_stops_dropping_at_the_byte_bound() -> None:
    client = Client(1000, 10**9)
    guard = _guard(max_body_bytes=4096, discard_bytes=100_000, discard_seconds=3600)
    status, body, closes = _answer(_post(guard, {}, client.receive))
    assert (status, closes) == (413, True)
    assert b"KP_MAX_BODY_BYTES" in body
    assert client.reads == 5 + 101  # 5 chunks to pass the limit, 101 to pass the bound


def test_guard_stops_dropping_at_the_time_bound() -> None:
    """A client that stops sending mid-body: the drop ends at the time bound, and the answer
    goes out."""
    client = Client(1000, 10, stall_s=60)
    guard = _guard(max_body_bytes=4096, discard_bytes=10**9, discard_seconds=0.01)
    status, _, closes = _answer(_post(guard, {"content-type": "text/plain"}, client.receive))
    assert (status, closes) == (415, True)
    assert client.reads == 11  # ten chunks, then the stalled read cut off at the bound


def test_guard_drops_nothing_for_a_client_waiting_for_100_continue() -> None:
    client = Client(1000, 10)
    headers = {"content-length": "5000", "expect": "100-continue"}
    status, _, closes = _answer(_post(_guard(max_body_bytes=4096), headers, client.receive))
    assert (status, closes) == (413, True)
    assert client.reads == 0  # a read would make the server send "100 Continue"
