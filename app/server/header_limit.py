"""KP_MAX_HEADER_BYTES, exactly (docs/operating/slow-clients.md): a request whose request line
and headers are larger gets 431 with an empty body, and the connection is closed.

granian's HTTP/1 server (hyper) holds the same limit as its read buffer, but checks it only
while the headers are incomplete: headers that arrive whole in one read pass it up to the
buffer's next size (a 40 KB header under a 32 KiB limit did). This wrapper, outside the app,
counts what hyper parsed: the request line and each header line as `name: value` with their
CRLFs, and the blank line that ends them."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

_REFUSED_HEADERS = [(b"content-length", b"0"), (b"connection", b"close")]


class HeaderLimit:
    """Answers 431 (empty body, Connection: close) to a request whose head is larger than
    `max_bytes`; everything else (lifespan, other requests) goes to `app` untouched."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            # The request line and headers as the client sent them (`name: value`, one space).
            target = len(scope.get("raw_path") or scope["path"].encode())
            if scope.get("query_string"):
                target += 1 + len(scope["query_string"])
            version = scope.get("http_version", "1.1")
            head = len(scope["method"]) + 1 + target + len(" HTTP/") + len(version) + 2
            head += sum(len(k) + 2 + len(v) + 2 for k, v in scope["headers"]) + 2
            if head > self.max_bytes:
                start = {"type": "http.response.start", "status": 431, "headers": _REFUSED_HEADERS}
                await send(start)
                await send({"type": "http.response.body", "body": b""})
                return
        await self.app(scope, receive, send)
