"""Slow and hostile clients against a live server (raw sockets): deadlines for the headers and
the body, header limits, the Host rule, and descriptors that run out. The header deadline and
limits are granian's (app/serve.py), the body deadline and the Host rule the app's
(app/api/edge.py): docs/operating/slow-clients.md.

Bounds are small here (KP_HEADER_TIMEOUT_S=1, KP_BODY_TIMEOUT_S=2) so the tests are quick;
each wait for the server allows many times the bound (a slow, busy machine): the tests assert
what the server does, not how soon.
"""

from __future__ import annotations

import json
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from tests.factories import make_trace, step
from tests.server import SERVE, LiveServer, Server, running_server

# Live servers (the launch-path check at the end aside): left out of make test-fast.
pytestmark = pytest.mark.server

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 2.0
MAX_HEADER_BYTES = 8192
#: Header lines a request may have: granian's HTTP/1 parser's bound (hyper's), not a setting.
MAX_HEADER_COUNT = 100
#: Longest any test waits for the server to act on a bound: generous, never a measurement.
PATIENCE_S = 30.0


@pytest.fixture(scope="module")
def bounded() -> Iterator[Server]:
    with running_server(
        header_timeout_s=str(HEADER_TIMEOUT_S),
        body_timeout_s=str(BODY_TIMEOUT_S),
        max_header_bytes=str(MAX_HEADER_BYTES),
    ) as server:
        yield server


def _connect(server: Server) -> socket.socket:
    parts = urlsplit(server.url)
    assert parts.hostname is not None
    assert parts.port is not None
    return socket.create_connection((parts.hostname, parts.port), timeout=PATIENCE_S)


def _read_until_closed(sock: socket.socket) -> tuple[bytes, bool]:
    """Everything the server sends, and whether it closed the connection (EOF or reset)
    within PATIENCE_S."""
    data = b""
    deadline = time.monotonic() + PATIENCE_S
    try:
        while time.monotonic() < deadline:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            chunk = sock.recv(65536)
            if not chunk:
                return data, True
            data += chunk
    except ConnectionResetError:
        return data, True
    except TimeoutError:
        pass
    return data, False


class _Dribble(threading.Thread):
    """Sends `data` a piece at a time, every `interval_s`, until told to stop or the server
    closes; as a slow client (or an attacker) does."""

    def __init__(self, sock: socket.socket, data: bytes, piece: int, interval_s: float) -> None:
        super().__init__(daemon=True)
        self.sock, self.data, self.piece, self.interval_s = sock, data, piece, interval_s
        self.stopped = threading.Event()

    def run(self) -> None:
        for start in range(0, len(self.data), self.piece):
            if self.stopped.wait(self.interval_s):
                return
            try:
                self.sock.sendall(self.data[start : start + self.piece])
            except OSError:
                return


def _response(data: bytes) -> tuple[int, dict[str, str], Any]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return status, headers, json.loads(body) if body else None


def _closed_by(server: Server, limit: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=PATIENCE_S).text
    found = re.search(rf'^kp_http_closed_by_limit_total{{limit="{limit}"}} (\S+)$', text, re.M)
    assert found, f"no kp_http_closed_by_limit_total for {limit}"
    return float(found.group(1))


def _send_all_then_read(server: Server, request: bytes) -> tuple[bytes, bool]:
    """The whole request, written while the answer is read (as a client that writes before
    it reads, on a socket whose buffers cannot hold it all)."""
    with _connect(server) as sock:
        writer = _Dribble(sock, request, 64 * 1024, 0)
        writer.start()
        try:
            return _read_until_closed(sock)
        finally:
            writer.stopped.set()
            writer.join()


def test_a_connection_that_sends_nothing_is_closed_without_an_answer(bounded: Server) -> None:
    with _connect(bounded) as sock:
        data, closed = _read_until_closed(sock)
    assert closed
    assert data == b""


def _closed_with_408(
    server: Server, head: bytes, payload: bytes, chunk: int, interval_s: float
) -> dict[str, Any]:
    """Sends `head`, then `payload` `chunk` bytes every `interval_s` seconds, until the server
    closes the connection; checks it answered 408 with Connection: close, and returns the
    answer's error entry."""
    with _connect(server) as sock:
        sock.sendall(head)
        dribble = _Dribble(sock, payload, chunk, interval_s)
        dribble.start()
        data, closed = _read_until_closed(sock)
        dribble.stopped.set()
    assert closed
    status, headers, body = _response(data)
    assert status == 408
    assert headers["connection"] == "close"
    entry: dict[str, Any] = body["detail"][0]
    return entry


def test_headers_that_never_end_are_closed_at_the_deadline(bounded: Server) -> None:
    """A byte every quarter of the deadline, for 250 deadlines: closed at the first one,
    without an answer (granian's header deadline, as nginx's client_header_timeout)."""
    with _connect(bounded) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: kp\r\nX-Slow: ")
        dribble = _Dribble(sock, b"a" * 1000, 1, HEADER_TIMEOUT_S / 4)
        dribble.start()
        data, closed = _read_until_closed(sock)
        dribble.stopped.set()
    assert closed
    assert data == b""


def test_a_body_that_never_ends_gets_408_and_a_close(bounded: Server) -> None:
    """The issue's probe: Content-Length 500000, sent at a few KB/s."""
    before = _closed_by(bounded, "body_timeout")
    head = (
        b"POST /evaluate HTTP/1.1\r\nHost: kp\r\nContent-Type: application/json\r\n"
        b"Content-Length: 500000\r\n\r\n"
    )
    entry = _closed_with_408(bounded, head, b" " * 500_000, 1024, BODY_TIMEOUT_S / 10)
    assert entry == {
        "loc": ["body"],
        "msg": f"the request body did not arrive within {BODY_TIMEOUT_S:g} s (KP_BODY_TIMEOUT_S)",
        "type": "body_timeout",
    }
    assert _closed_by(bounded, "body_timeout") > before
    # The app, which saw the client go, counts the 408 it was answered with.
    metrics = httpx.get(f"{bounded.url}/metrics", timeout=PATIENCE_S).text
    assert re.search(r'^kp_http_requests_total{[^}]*status="408"[^}]*} [1-9]', metrics, re.M)


@pytest.mark.parametrize("size", [MAX_HEADER_BYTES, 100_000, 1_000_000])
def test_an_oversized_header_gets_431(bounded: Server, size: int) -> None:
    request = b"GET /healthz HTTP/1.1\r\nHost: kp\r\nX-Big: " + b"a" * size + b"\r\n\r\n"
    data, closed = _send_all_then_read(bounded, request)
    assert closed
    status, headers, _ = _response(data)
    assert status == 431
    assert headers["connection"] == "close"


@pytest.fixture(scope="module")
def default_bounds() -> Iterator[Server]:
    """A server with the default KP_MAX_HEADER_BYTES (32 KiB)."""
    with running_server() as server:
        yield server


@pytest.mark.parametrize("size", [33_000, 36_000, 40_000])
def test_a_namespace_header_past_32_kib_gets_431_not_422(default_bounds: Server, size: int) -> None:
    """Headers that arrive whole in one read pass granian's own check up to its buffer's next
    size (64 KiB); the limit is exact all the same (app/server/header_limit.py)."""
    request = b"GET /cache HTTP/1.1\r\nHost: kp\r\nKP-Namespace: " + b"a" * size + b"\r\n\r\n"
    data, closed = _send_all_then_read(default_bounds, request)
    assert closed
    status, headers, body = _response(data)
    assert status == 431
    assert headers["connection"] == "close"
    assert body is None


def test_the_header_limit_is_the_request_line_and_headers_to_the_byte(
    default_bounds: Server,
) -> None:
    """32,768 bytes of request line and headers (the blank line included) are served; one
    byte more is 431."""
    start = b"GET /healthz HTTP/1.1\r\nHost: kp\r\nConnection: close\r\nX-Pad: "
    end = b"\r\n\r\n"
    at_limit = start + b"a" * (32_768 - len(start) - len(end)) + end
    assert len(at_limit) == 32_768
    data, closed = _send_all_then_read(default_bounds, at_limit)
    assert closed
    assert _response(data)[0] == 200
    past = start + b"a" * (32_769 - len(start) - len(end)) + end
    data, closed = _send_all_then_read(default_bounds, past)
    assert closed
    assert _response(data)[0] == 431


def test_many_small_headers_past_the_size_limit_get_431(bounded: Server) -> None:
    lines = b"".join(b"X-%d: %s\r\n" % (i, b"v" * 300) for i in range(MAX_HEADER_COUNT - 5))
    data, closed = _send_all_then_read(
        bounded, b"GET /healthz HTTP/1.1\r\nHost: kp\r\n" + lines + b"\r\n"
    )
    assert closed
    assert _response(data)[0] == 431


@pytest.mark.parametrize("count", [MAX_HEADER_COUNT + 1, 10_000])
def test_too_many_headers_get_431(bounded: Server, count: int) -> None:
    lines = b"".join(b"X-%d: 1\r\n" % i for i in range(count - 1))
    data, closed = _send_all_then_read(
        bounded, b"GET /healthz HTTP/1.1\r\nHost: kp\r\n" + lines + b"\r\n"
    )
    assert closed
    assert _response(data)[0] == 431


def test_headers_at_the_limits_are_served(bounded: Server) -> None:
    lines = b"".join(b"X-%d: 1\r\n" % i for i in range(MAX_HEADER_COUNT - 2))
    with _connect(bounded) as sock:
        sock.sendall(
            b"GET /healthz HTTP/1.1\r\nHost: kp\r\nConnection: close\r\n" + lines + b"\r\n"
        )
        data, closed = _read_until_closed(sock)
    assert closed
    status, _, body = _response(data)
    assert (status, body["status"]) == (200, "ok")


@pytest.mark.parametrize(
    "host_lines",
    [b"", b"Host:\r\n", b"Host: kp\r\nHost: other\r\n"],
    ids=["no Host", "empty Host", "two Host lines"],
)
def test_http11_needs_exactly_one_host(bounded: Server, host_lines: bytes) -> None:
    before = _closed_by(bounded, "host")
    with _connect(bounded) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\n" + host_lines + b"\r\n")
        data, closed = _read_until_closed(sock)
    assert closed
    status, _, body = _response(data)
    assert status == 400
    assert body["detail"][0]["loc"] == ["header", "host"]
    assert _closed_by(bounded, "host") > before


def test_http10_without_host_is_served(bounded: Server) -> None:
    with _connect(bounded) as sock:
        sock.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
        data, closed = _read_until_closed(sock)
    assert closed
    assert _response(data)[0] == 200


def test_a_kept_alive_connection_is_served_past_the_header_deadline(bounded: Server) -> None:
    """The header deadline starts again after each answer: requests a little apart, over
    more than the deadline in all, are all served."""
    request = b"GET /healthz HTTP/1.1\r\nHost: kp\r\n\r\n"
    with _connect(bounded) as sock:
        for _ in range(4):
            sock.sendall(request)
            time.sleep(HEADER_TIMEOUT_S * 0.3)
        sock.sendall(request.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
        data, closed = _read_until_closed(sock)
    assert closed
    assert data.count(b"HTTP/1.1 200 OK\r\n") == 5


def test_a_body_answered_before_it_is_read_is_not_taken_for_the_next_headers(
    bounded: Server,
) -> None:
    """GET /healthz answers without reading the body; the rest of it, larger than
    KP_MAX_HEADER_BYTES, is never read as the next request's headers: granian closes the
    connection after such an answer (or, reading the body, serves the next request)."""
    half = b"x" * MAX_HEADER_BYTES
    with _connect(bounded) as sock:
        sock.sendall(
            b"GET /healthz HTTP/1.1\r\nHost: kp\r\nContent-Length: %d\r\n\r\n" % (2 * len(half) + 1)
            + half
        )
        first = b""
        while not (b'"status":"ok"' in first and first.endswith(b"}")):
            first += sock.recv(65536)
        try:
            sock.sendall(half + b"x")
            time.sleep(0.2)  # the rest of the body, then (in another read) the next request
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: kp\r\nConnection: close\r\n\r\n")
        except OSError:
            pass  # closed by the server
        rest, closed = _read_until_closed(sock)
    assert closed
    assert first.startswith(b"HTTP/1.1 200 ")
    assert rest == b"" or rest.startswith(b"HTTP/1.1 200 "), rest[:200]


_WEBSOCKET = (
    b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
)
_H2C = (
    b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n"
)


@pytest.mark.parametrize("upgrade", [_WEBSOCKET, _H2C], ids=["websocket", "h2c"])
def test_a_request_asking_to_upgrade_is_answered_as_http(bounded: Server, upgrade: bytes) -> None:
    """The service speaks HTTP/1.1 only (no WebSocket endpoint, granian's WebSockets off): a
    handshake is answered as the plain request it also is, and the next request on the
    connection is read as a request."""
    with _connect(bounded) as sock:
        sock.sendall(
            b"GET /healthz HTTP/1.1\r\nHost: kp\r\n" + upgrade + b"\r\n"
            b"GET /healthz HTTP/1.1\r\nHost: kp\r\nConnection: close\r\n\r\n"
        )
        data, closed = _read_until_closed(sock)
    assert closed
    assert data.count(b"HTTP/1.1 200 OK\r\n") == 2
    assert b"101 Switching" not in data


def test_an_upgrade_request_with_a_body_is_answered_not_left_hanging(bounded: Server) -> None:
    """The body after an upgrade request's headers is read as its body (Content-Length): the
    request is answered and the connection goes on."""
    body = json.dumps(make_trace()).encode()
    head = b"POST /evaluate HTTP/1.1\r\nHost: kp\r\nContent-Type: application/json\r\n"
    with _connect(bounded) as sock:
        sock.sendall(head + b"Content-Length: %d\r\n" % len(body) + _WEBSOCKET + b"\r\n" + body)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: kp\r\nConnection: close\r\n\r\n")
        data, closed = _read_until_closed(sock)
    assert closed
    assert data.startswith(b"HTTP/1.1 200 OK\r\n"), data[:300]
    assert data.count(b"HTTP/1.1 200 OK\r\n") == 2


def _long_trace(size: int) -> bytes:
    """A valid trace of about `size` bytes (every string within KP_MAX_STRING_CHARS)."""
    steps = [step(i, "thought", "word " * 4000) for i in range(1, size // 20_000 + 2)]
    return json.dumps(make_trace(steps=steps)).encode()


def test_a_slow_honest_client_is_served_with_the_default_bounds() -> None:
    """100 KB at 20 KB/s (about 5 s) is within KP_BODY_TIMEOUT_S's default."""
    body = _long_trace(100_000)
    assert len(body) >= 100_000
    with running_server() as server, _connect(server) as sock:
        sock.sendall(
            b"POST /evaluate HTTP/1.1\r\nHost: kp\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        dribble = _Dribble(sock, body, 2000, 0.1)
        dribble.start()
        data, closed = _read_until_closed(sock)
        dribble.join()
    assert closed
    status, _, answer = _response(data)
    assert status == 200, answer
    assert 0 <= answer["score"] <= 1


def _with_nofile(soft: int, hard: int) -> tuple[str, ...]:
    """The server's command, started with these descriptor limits (as `ulimit -n` would)."""
    wrapper = (
        "import os, resource, sys; "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard})); "
        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    )
    return (sys.executable, "-c", wrapper, *SERVE[1:])


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=PATIENCE_S).text
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    assert found, f"no {name} in /metrics"
    return float(found.group(1))


def _healthz(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code
    except httpx.TransportError:
        return None


@pytest.mark.slow
def test_300_slow_clients_with_256_descriptors_no_longer_shut_out_healthz(
    tmp_path: Path,
) -> None:
    env = {"KP_EMBEDDER": "none", "KP_LOG_LEVEL": "info", "KP_HEADER_TIMEOUT_S": "3"}
    live = LiveServer(env, tmp_path / "server.log", _with_nofile(256, 256))
    server = Server(live.url, None)
    slow: list[socket.socket] = []
    dribbles: list[_Dribble] = []
    try:
        for _ in range(300):
            sock = _connect(server)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: kp\r\nX-Slow: ")
            slow.append(sock)
        # One byte a second each, for far longer than the bound.
        for sock in slow:
            dribble = _Dribble(sock, b"a" * 120, 1, 1.0)
            dribble.start()
            dribbles.append(dribble)
        deadline = time.monotonic() + 60
        while _healthz(live.url) != 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _healthz(live.url) == 200
        # Closed by the server: a dribble ends at its first failing send.
        deadline = time.monotonic() + PATIENCE_S
        while sum(d.is_alive() for d in dribbles) and time.monotonic() < deadline:
            time.sleep(0.5)
        alive = sum(d.is_alive() for d in dribbles)
        assert alive == 0, f"{alive} slow clients still connected long after the bound"
        assert _metric(live.url, "kp_fd_exhausted_total") >= 1
        assert _metric(live.url, "process_max_fds") == 256
        # Said once, then once again when they are back, with the accepts refused meanwhile:
        # granian's own line for each failed accept is counted, not repeated.
        logged = live.log()
        assert logged.count("out of file descriptors") == 1
        assert "Too many open files" not in logged
        (back,) = [line for line in logged.splitlines() if "available again" in line]
        assert json.loads(back)["accepts_failed"] >= 1  # 300 connections, 256 descriptors
    finally:
        for dribble in dribbles:
            dribble.stopped.set()
        for sock in slow:
            sock.close()
        live.stop()


def test_the_soft_descriptor_limit_is_raised_to_the_hard_limit(tmp_path: Path) -> None:
    """granian raises it at start: slow clients meet the hard limit, not the soft one."""
    env = {"KP_EMBEDDER": "none", "KP_LOG_LEVEL": "info"}
    live = LiveServer(env, tmp_path / "server.log", _with_nofile(512, 4096))
    try:
        assert _metric(live.url, "process_max_fds") == 4096
    finally:
        live.stop()


def test_every_launch_path_runs_app_serve() -> None:
    """make run, the image and both compose files start the service through app.serve (the
    bounds above hold there); the compose files give it a descriptor limit it can raise its
    own to."""
    root = Path(__file__).resolve().parent.parent
    assert "-m app.serve" in (root / "Makefile").read_text()
    assert 'CMD ["python3", "-m", "app.serve"' in (root / "Dockerfile").read_text()
    for name in ("docker-compose.yml", "docker-compose.scale.yml"):
        service = yaml.safe_load((root / name).read_text())["services"]["kp-scoring"]
        assert "command" not in service, name
        assert service["ulimits"]["nofile"]["hard"] >= 65536, name
