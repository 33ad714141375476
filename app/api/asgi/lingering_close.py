"""A request refused before its body was read to the end (401, 413, 415, 429...): the rest of
the body is read and dropped, within bounds, before the answer goes out and the connection
closes. The HTTP server (granian) closes a connection whose request body was left unread,
and a client that sends its whole body before it reads (Python's urllib, many simple clients)
would then see a reset instead of the answer; nginx, in front, does the same itself."""

from __future__ import annotations

import asyncio
import logging

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("app.access")

# 64 MiB covers the usual mistakes (a batch of many traces, a trace with a file pasted in) and
# is dropped on loopback in well under a second; 10 s lets it come over a link of ~50 Mbit/s.
# Dropping costs what reading a body costs and keeps no memory; past either bound the answer
# goes out at once (the client may see a reset).
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
        held: list[Message] = []

        async def receive_seen() -> Message:
            nonlocal body_ended
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                body_ended = True
            return message

        async def send_after_drop(message: Message) -> None:
            if message["type"] == "http.response.start" and not body_ended:
                # Answered before the body was read to the end: close after this answer.
                message["headers"] = [*message.get("headers", []), (b"connection", b"close")]
                held.append(message)
                return
            if not held:
                await send(message)
                return
            held.append(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                await self._drop_rest(scope, receive)
                for each in held:
                    await send(each)
                held.clear()

        await self.app(scope, receive_seen, send_after_drop)

    async def _drop_rest(self, scope: Scope, receive: Receive) -> None:
        headers = Headers(scope=scope)
        declared = headers.get("content-length", "")
        if headers.get("expect", "").lower() == "100-continue":
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
    return Headers(scope=scope).get("content-length", "").strip() != "0"
