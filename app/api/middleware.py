"""One ASGI middleware in front of every route: request id, body limits, metrics, access log.

Pure ASGI (no BaseHTTPMiddleware) because it sits on the hot path of every request.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import orjson

from app.core.errors import error_body, field_error
from app.core.metrics import Metrics
from app.core.request_context import request_id_var
from app.schemas.limits import json_depth_exceeds

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger("app.access")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_JSON_TYPE = re.compile(r"^application/([a-z0-9.+-]*\+)?json\s*(;.*)?$", re.IGNORECASE)

# The rest of a refused body is read and dropped, up to these bounds, before the connection
# closes (nginx's lingering close): a client that sends its whole body before it reads (urllib,
# many simple clients) then gets the 4xx instead of a reset. 64 MiB covers the usual mistakes
# (a batch of many traces, a trace with a file pasted in) and is dropped on loopback in well
# under a second; 10 s lets it come over a link of ~50 Mbit/s. Dropping costs what reading a
# body costs and keeps no memory; a body past either bound is cut off (the client sees a reset).
DISCARD_BYTES = 64 * 1024 * 1024
DISCARD_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class _Refusal:
    status: int
    body: dict[str, Any]
    #: The request body is not (all) read: drop the rest after the answer, then close.
    body_left: bool = False


class RequestGuard:
    def __init__(
        self,
        app: ASGIApp,
        *,
        metrics: Metrics,
        max_body_bytes: int,
        max_json_depth: int,
        discard_bytes: int = DISCARD_BYTES,
        discard_seconds: float = DISCARD_SECONDS,
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.max_json_depth = max_json_depth
        self.discard_bytes = discard_bytes
        self.discard_seconds = discard_seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        given_id = headers.get("x-request-id", "")
        request_id = given_id if _REQUEST_ID.match(given_id) else uuid.uuid4().hex
        token = request_id_var.set(request_id)
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            refusal = None
            if scope["method"] in ("POST", "PUT", "PATCH"):
                refusal, receive = await self._read_body(headers, receive)
            if refusal is None:
                await self.app(scope, receive, send_with_id)
            elif not refusal.body_left:
                await _send_json(send_with_id, refusal.status, refusal.body)
            else:
                await self._refuse_unread(headers, refusal, receive, send_with_id)
        finally:
            elapsed = time.perf_counter() - started
            route = scope.get("route")
            name = getattr(route, "path", "unmatched")
            self.metrics.requests.labels(name, scope["method"], str(status)).inc()
            self.metrics.latency.labels(name).observe(elapsed)
            if status >= 400:
                self.metrics.errors.labels(name, str(status)).inc()
            log.info(
                "request",
                extra={
                    "method": scope["method"],
                    "path": scope["path"],
                    "status": status,
                    "duration_ms": round(elapsed * 1000, 3),
                },
            )
            request_id_var.reset(token)

    async def _read_body(
        self, headers: dict[str, str], receive: Receive
    ) -> tuple[_Refusal | None, Receive]:
        """The whole body, read up front so that limits answer before any parsing."""
        content_type = headers.get("content-type")
        if content_type is not None and not _JSON_TYPE.match(content_type):
            return _Refusal(
                415,
                _refusal_body(
                    ("header", "content-type"),
                    f"must be application/json, got {content_type!r}",
                    "unsupported_media_type",
                ),
                body_left=True,
            ), receive
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return self._too_large(), receive
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return _Refusal(
                    400, _refusal_body(("body",), "the client closed the connection", "disconnect")
                ), receive
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return self._too_large(), receive
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if json_depth_exceeds(body, self.max_json_depth):
            # Checked before parsing: a deep body would exhaust the parser's recursion.
            msg = f"JSON nests deeper than {self.max_json_depth} levels (KP_MAX_JSON_DEPTH)"
            return _Refusal(422, _refusal_body(("body",), msg, "limit_exceeded")), receive
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return None, replay

    def _too_large(self) -> _Refusal:
        return _Refusal(
            413,
            _refusal_body(
                ("body",),
                f"request body is larger than {self.max_body_bytes} bytes (KP_MAX_BODY_BYTES)",
                "body_too_large",
            ),
            body_left=True,
        )

    async def _refuse_unread(
        self, headers: dict[str, str], refusal: _Refusal, receive: Receive, send: Send
    ) -> None:
        """Answer first, then drop the rest of the body within the bounds, then close.

        The answer goes out before the body is dropped, so a client that reads while it sends
        sees it at once; the response ends (and the connection closes) only after the drop.
        """
        await _send_json(send, refusal.status, refusal.body, closing=True)
        declared = headers.get("content-length", "")
        if headers.get("expect", "").lower() == "100-continue":
            pass  # the client waits for "100 Continue" before it sends: there is nothing to drop
        elif declared.isdigit() and int(declared) > self.discard_bytes:
            log.info("refused body not read: larger than the discard bound")
        elif not await self._discard_rest(receive):
            log.info("refused body still coming at the discard bound: connection closed")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _discard_rest(self, receive: Receive) -> bool:
        """Reads and drops the rest of the body; False when it goes past the bounds."""
        dropped = 0
        try:
            async with asyncio.timeout(self.discard_seconds):
                while dropped <= self.discard_bytes:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return True
                    dropped += len(message.get("body", b""))
                    if not message.get("more_body", False):
                        return True
        except TimeoutError:
            pass
        return False


def _refusal_body(loc: tuple[str, ...], msg: str, kind: str) -> dict[str, Any]:
    return error_body([field_error(loc, msg, kind)])


async def _send_json(
    send: Send, status: int, body: dict[str, Any], *, closing: bool = False
) -> None:
    """A JSON answer. `closing`: with Connection: close, and left open for the caller to end."""
    payload = orjson.dumps(body)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload))]
    if closing:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": closing})
