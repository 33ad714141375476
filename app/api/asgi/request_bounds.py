"""The bounds of a request that the HTTP server (granian, app/serve.py) does not hold: the
body deadline (408, then close) and the HTTP/1.1 rule that a request names exactly one Host
(400). The server holds the rest: the header deadline, which also closes idle connections,
and the header size and count limits (docs/operating/slow-clients.md)."""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.asgi.base import detail, send_json
from app.core.connection_metrics import CONNECTIONS

_CLOSE = [(b"connection", b"close")]


class BodyTimeoutError(Exception):
    """The body did not arrive by its deadline: raised from `receive` into whatever reads it."""


class RequestBounds:
    def __init__(self, app: ASGIApp, *, body_timeout_s: float) -> None:
        self.app = app
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # granian hands a request without Host on with an empty one: an empty Host is as
        # invalid for an http URI (RFC 9110, 4.2.1) as a missing one.
        hosts = [value for name, value in scope["headers"] if name == b"host"]
        if len(hosts) > 1 or (scope.get("http_version") == "1.1" and not any(hosts)):
            CONNECTIONS.closed_by_limit.labels("host").inc()
            msg = "an HTTP/1.1 request must have exactly one Host header (RFC 9112, 3.2)"
            await send_json(send, 400, detail(("header", "host"), msg, "host"), _CLOSE)
            return
        if not _may_have_body(scope):
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s
        body_ended = False
        started = False

        async def bounded_receive() -> Message:
            nonlocal body_ended
            if body_ended:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise BodyTimeoutError from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_ended = True
            return message

        async def seen_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, bounded_receive, seen_send)
        except BodyTimeoutError:
            CONNECTIONS.closed_by_limit.labels("body_timeout").inc()
            if started:
                raise  # an answer is under way: the server ends the connection
            msg = (
                f"the request body did not arrive within {self.body_timeout_s:g} s "
                "(KP_BODY_TIMEOUT_S)"
            )
            await send_json(send, 408, detail(("body",), msg, "body_timeout"), _CLOSE)


def _may_have_body(scope: Scope) -> bool:
    """A body may come: a chunked one, or a declared length that is not 0."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            declared: bytes = value
            return declared.strip() != b"0"
        if name == b"transfer-encoding":
            return True
    return False
