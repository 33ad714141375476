"""The body, read whole before any parsing: 413 past KP_MAX_BODY_BYTES (declared or sent), 400
when it is not UTF-8 text (JSON exchanged between systems is UTF-8, RFC 8259 section 8.1: a
UTF-16 or UTF-32 body, which a JSON parser would quietly guess, is refused, as is a byte that
is not UTF-8), then 422 when its JSON nests past KP_MAX_JSON_DEPTH (checked before a parser
could exhaust its recursion on it). Later pieces and the route get it replayed."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from app.api.asgi.base import detail, replaying, send_json
from app.api.asgi.content_type import has_json_body
from app.schemas.limits import json_depth_exceeds


class BodySize:
    def __init__(self, app: ASGIApp, *, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not has_json_body(scope):
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._too_large(send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                refusal = detail(("body",), "the client closed the connection", "disconnect")
                await send_json(send, 400, refusal)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._too_large(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        problem = not_utf8(body)
        if problem is not None:
            await send_json(send, 400, detail(("body",), problem, "body_not_utf8"))
            return
        await self.app(scope, replaying(body, receive), send)

    async def _too_large(self, send: Send) -> None:
        msg = f"request body is larger than {self.max_body_bytes} bytes (KP_MAX_BODY_BYTES)"
        await send_json(send, 413, detail(("body",), msg, "body_too_large"))


_UTF16_32_MARKS = (b"\xff\xfe", b"\xfe\xff")


def not_utf8(body: bytes) -> str | None:
    """Why `body` is not UTF-8 text, or None. JSON text starts with an ASCII character, so a
    NUL among its first four bytes, or a UTF-16/32 byte order mark, is UTF-16 or UTF-32 (RFC
    4627's detection); a UTF-8 byte order mark is allowed (RFC 8259 lets a parser ignore it)."""
    if body.startswith(_UTF16_32_MARKS) or b"\x00" in body[:4]:
        return "the body is UTF-16 or UTF-32: send JSON as UTF-8 text (RFC 8259)"
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"the body is not UTF-8: byte {exc.start} ({body[exc.start]:#04x}) {exc.reason}"
    return None


class JsonDepth:
    def __init__(self, app: ASGIApp, *, max_json_depth: int) -> None:
        self.app = app
        self.max_json_depth = max_json_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not has_json_body(scope):
            await self.app(scope, receive, send)
            return
        message = await receive()
        body: bytes = message.get("body", b"")
        if json_depth_exceeds(body, self.max_json_depth):
            msg = f"JSON nests deeper than {self.max_json_depth} levels (KP_MAX_JSON_DEPTH)"
            await send_json(send, 422, detail(("body",), msg, "limit_exceeded"))
            return
        await self.app(scope, replaying(body, receive), send)
