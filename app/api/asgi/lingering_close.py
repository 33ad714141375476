"""Lingering close: a request refused before its body was read to the end (401, 413, 415,
429...) is answered at once, then the rest of the body is read and dropped, within bounds,
before the connection closes, as nginx does: a client that sends its whole body before it reads
(Python's urllib, many simple clients) then gets the answer instead of a connection reset."""

from __future__ import annotations

import asyncio
import logging

from app.api.asgi.base import ASGIApp, Message, Receive, Scope, Send, header

log = logging.getLogger("app.access")

# 64 MiB covers the usual mistakes (a batch of many traces, a trace with a file pasted in) and
# is dropped on loopback in well under a second; 10 s lets it come over a link of ~50 Mbit/s.
# Dropping costs what reading a body costs and keeps no memory; a body past either bound is
# cut off (the client sees a reset).
DISCARD_BYTES = 64 * 1024 * 1024
DISCARD_SECONDS = 10.0


class LingeringClose:
    def __init__(
        self,
        app: ASGIApp,
        *,
        discard_bytes: int = DISCARD_BYTES,
        discard_seconds: float = DISCARD_SECONDS,
    ) -> None:
        self.app = app
        self.discard_bytes = discard_bytes
        self.discard_seconds = discard_seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _has_body(scope):
            await self.app(scope, receive, send)
            return
        body_ended = False
        lingering = False

        async def receive_seen() -> Message:
            nonlocal body_ended
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                body_ended = True
            return message

        async def send_then_drop(message: Message) -> None:
            nonlocal lingering
            if message["type"] == "http.response.start" and not body_ended:
                # Answered before the body was read to the end: close after dropping the rest.
                lingering = True
                message["headers"] = [*message.get("headers", []), (b"connection", b"close")]
            if (
                lingering
                and message["type"] == "http.response.body"
                and not message.get("more_body", False)
            ):
                # The answer goes out before the body is dropped, so a client that reads while
                # it sends sees it at once; the response ends only after the drop.
                await send({**message, "more_body": True})
                await self._drop_rest(scope, receive)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            await send(message)

        await self.app(scope, receive_seen, send_then_drop)

    async def _drop_rest(self, scope: Scope, receive: Receive) -> None:
        declared = header(scope, b"content-length") or ""
        if (header(scope, b"expect") or "").lower() == "100-continue":
            pass  # the client waits for "100 Continue" before it sends: there is nothing to drop
        elif declared.isdigit() and int(declared) > self.discard_bytes:
            log.info("refused body not read: larger than the discard bound")
        elif not await self._discard(receive):
            log.info("refused body still coming at the discard bound: connection closed")

    async def _discard(self, receive: Receive) -> bool:
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


def _has_body(scope: Scope) -> bool:
    """Whether a body may come (a method that has one, not declared empty)."""
    if scope["method"] not in ("POST", "PUT", "PATCH"):
        return False
    return (header(scope, b"content-length") or "").strip() != "0"
