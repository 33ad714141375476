"""The two pieces of hand-written ASGI middleware: what must act on a request before its body
is read, or while it is read (docs/decisions/one-door.md).

- `Edge`, outermost, whatever answers: the request id, the access log and the request
  metrics, the HTTP/1.1 Host rule, the body's deadline, and the lingering close of a request
  refused before its body was read.
- `Admission`: the caller (the service's `admit`) before a byte of the body is read; then, for
  a JSON body, its type, size, encoding and nesting, the body read once and handed on.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from typing import Any
from urllib.parse import unquote_plus

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.errors import error_response
from app.core import namespaces
from app.core.connection_metrics import CONNECTIONS
from app.core.errors import ServiceError
from app.core.metrics import Metrics
from app.core.request_context import request_id_var
from app.guards.api_keys import Scope as KeyScope
from app.schemas.limits import json_problem
from app.service.scoring_service import Caller

access_log = logging.getLogger("app.access")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_CLOSE = (b"connection", b"close")
_HOST_REFUSAL = ServiceError(
    400,
    "host",
    "an HTTP/1.1 request must have exactly one Host header (RFC 9112, 3.2)",
    loc=("header", "host"),
    headers={"Connection": "close"},
)
#: A body refused before it was read is read and dropped within these bounds before the
#: answer goes out: the HTTP server closes a connection whose body was left unread, and a
#: client that sends its whole body before it reads would see a reset instead of the answer.
#: 64 MiB covers the usual mistakes and comes over a ~50 Mbit/s link in 10 s.
DISCARD_BYTES = 64 * 1024 * 1024
DISCARD_SECONDS = 10.0

BODY_METHODS = ("POST", "PUT", "PATCH")
#: Bodies read as a stream by their route, which applies its own type and limits
#: (POST /cache/import: NDJSON, KP_CACHE_IMPORT_MAX_BYTES).
STREAMED = frozenset({"/cache/import"})
_JSON_TYPE = re.compile(r"^application/([a-z0-9.+-]*\+)?json\s*(;.*)?$", re.IGNORECASE)
_UTF16_32_MARKS = (b"\xff\xfe", b"\xfe\xff")
#: Query parameters in which clients commonly put keys, as `_key_in_query` reads them: any
#: case, any separators, percent-encoded or not (api_key, API-KEY, apiKey, api%5Fkey are one).
_KEY_PARAMS = frozenset(
    {"apikey", "key", "token", "accesstoken", "authtoken", "apitoken", "bearer",
     "authorization", "xapikey"}
)  # fmt: skip


#: The routes that need a key, and which scope (every path under /cache/ needs admin too).
_SCOPES: dict[str, KeyScope] = {
    "/evaluate": "evaluate",
    "/evaluate/batch": "evaluate",
    "/contribution": "evaluate",
    "/mcp": "evaluate",  # the scoring tools
    "/cache": "admin",
}
_NAMESPACE_HEADER = namespaces.HEADER.lower().encode()


class Edge:
    def __init__(
        self,
        app: ASGIApp,
        *,
        metrics: Metrics,
        body_timeout_s: float,
        discard_bytes: int = DISCARD_BYTES,
        discard_seconds: float = DISCARD_SECONDS,
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.body_timeout_s = body_timeout_s
        self.discard = (discard_bytes, discard_seconds)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started_at = time.perf_counter()
        given_id, length, hosts, named = b"", b"", 0, False
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                given_id = value
            elif name == b"content-length":
                length = value
            elif name == b"host":
                hosts, named = hosts + 1, named or bool(value)
        request_id = given_id.decode("latin-1")
        if not _REQUEST_ID.match(request_id):
            request_id = uuid.uuid4().hex
        token = request_id_var.set(request_id)
        # A body may come (a method that has one, not declared empty): it has a deadline, and
        # a refusal before its end drops the rest before answering.
        may_have_body = scope["method"] in BODY_METHODS and length.strip() != b"0"
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s
        body_ended = not may_have_body
        status = 500
        started = False
        held: list[Message] = []

        async def edge_receive() -> Message:
            nonlocal body_ended
            if body_ended:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                body_ended = True  # nothing more is read: the connection closes after the 408
                CONNECTIONS.closed_by_limit.labels("body_timeout").inc()
                raise _body_timeout(self.body_timeout_s) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_ended = True
            return message

        async def edge_send(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                given = message.get("headers", [])
                extra = [(b"x-request-id", request_id.encode())]
                # Answered before the body ended: close after this answer.
                if not body_ended and not any(k.lower() == b"connection" for k, _ in given):
                    extra.append(_CLOSE)
                message["headers"] = [*given, *extra]
            if not held and body_ended:
                await send(message)
                return
            held.append(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                await _drop_rest(scope["headers"], edge_receive, *self.discard)
                for each in held:
                    await send(each)
                held.clear()

        try:
            # HTTP/1.1 names exactly one Host (RFC 9112, 3.2). granian passes a missing one on
            # as empty, as invalid for an http URI (RFC 9110, 4.2.1) as a missing one.
            if hosts > 1 or (not named and scope.get("http_version") == "1.1"):
                CONNECTIONS.closed_by_limit.labels("host").inc()
                await error_response(_HOST_REFUSAL)(scope, receive, edge_send)
                return
            await self.app(scope, edge_receive, edge_send)
        except ServiceError as exc:  # every refusal of the middleware and the routes
            if started:
                raise  # an answer is under way: the server ends the connection
            await error_response(exc)(scope, receive, edge_send)
        finally:
            request_id_var.reset(token)
            elapsed = time.perf_counter() - started_at
            route = getattr(scope.get("route"), "path", "unmatched")
            m = self.metrics
            m.child(m.requests, route, scope["method"], str(status)).inc()
            m.child(m.latency, route).observe(elapsed)
            if status >= 400:
                m.child(m.errors, route, str(status)).inc()
            extra: dict[str, Any] = {
                "method": scope["method"],
                "path": scope["path"],
                "status": status,
                "duration_ms": round(elapsed * 1000, 3),
            }
            caller: Caller | None = scope.get("state", {}).get("caller")
            if caller is not None:  # a checked key name and namespace: safe in a log line
                if caller.key is not None:
                    extra["api_key"] = caller.key.name
                extra["namespace"] = caller.namespace
            access_log.info("request", extra=extra)


def _body_timeout(seconds: float) -> ServiceError:
    msg = f"the request body did not arrive within {seconds:g} s (KP_BODY_TIMEOUT_S)"
    return ServiceError(408, "body_timeout", msg, loc=("body",), headers={"Connection": "close"})


async def _drop_rest(
    headers: list[tuple[bytes, bytes]], receive: Receive, max_bytes: int, max_seconds: float
) -> None:
    """Reads and drops what is left of a refused body, within the discard bounds."""
    found = {k: v for k, v in headers if k in (b"content-length", b"expect")}
    declared = found.get(b"content-length", b"")
    if found.get(b"expect", b"").lower() == b"100-continue":
        return  # the client waits for "100 Continue" before it sends: nothing to drop
    if declared.isdigit() and int(declared) > max_bytes:
        access_log.info("refused body not read: larger than the discard bound")
        return
    dropped = 0
    try:
        async with asyncio.timeout(max_seconds):
            while dropped <= max_bytes:
                message = await receive()
                dropped += len(message.get("body", b""))
                if message["type"] == "http.disconnect" or not message.get("more_body", False):
                    return
    except (TimeoutError, ServiceError):
        pass
    access_log.info("refused body still coming at the discard bound: connection closed")


class Admission:
    def __init__(self, app: ASGIApp, *, max_body_bytes: int, max_json_depth: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_json_depth = max_json_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        needed = _SCOPES.get(path) or ("admin" if path.startswith("/cache/") else None)
        # A refusal (ServiceError) is Edge's to answer.
        if needed is not None:
            authorization, namespace = [], []
            for name, value in scope["headers"]:
                if name == b"authorization":
                    authorization.append(value.decode("latin-1"))
                elif name == _NAMESPACE_HEADER:
                    namespace.append(value.decode("latin-1"))
            query: bytes = scope.get("query_string", b"")
            in_query = _key_in_query(query) if query else None
            caller = await scope["app"].state.service.admit(
                needed, authorization, namespace, in_query
            )
            scope.setdefault("state", {})["caller"] = caller
        if scope["method"] in BODY_METHODS and path not in STREAMED:
            body = await self._json_body(scope, receive)
            receive = _replaying(body, receive)
        await self.app(scope, receive, send)

    async def _json_body(self, scope: Scope, receive: Receive) -> bytes:
        """The body, read once: 415 unless JSON, 413 past KP_MAX_BODY_BYTES (declared or
        sent), 400 unless UTF-8 text, 422 past KP_MAX_JSON_DEPTH or for what JSON does not
        allow and Python's parser would take or fail on (schemas/limits.json_problem)."""
        headers = dict(scope["headers"])
        content_type = headers.get(b"content-type")
        if content_type is not None and not _JSON_TYPE.match(content_type.decode("latin-1")):
            msg = f"must be application/json, got {content_type.decode('latin-1')!r}"
            raise ServiceError(415, "unsupported_media_type", msg, loc=("header", "content-type"))
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large()
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                msg = "the client closed the connection"
                raise ServiceError(400, "disconnect", msg, loc=("body",))
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        # JSON between systems is UTF-8 (RFC 8259 8.1). A NUL among the first four bytes, or a
        # UTF-16/32 byte order mark, is UTF-16 or UTF-32 (RFC 4627's detection); a UTF-8 byte
        # order mark is allowed (RFC 8259 lets a parser ignore it).
        if body.startswith(_UTF16_32_MARKS) or b"\x00" in body[:4]:
            msg = "the body is UTF-16 or UTF-32: send JSON as UTF-8 text (RFC 8259)"
            raise ServiceError(400, "body_not_utf8", msg, loc=("body",))
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            msg = f"the body is not UTF-8: byte {exc.start} ({body[exc.start]:#04x}) {exc.reason}"
            raise ServiceError(400, "body_not_utf8", msg, loc=("body",)) from None
        problem = json_problem(body, self.max_json_depth)
        if problem is not None:
            raise ServiceError(422, problem[0], problem[1], loc=("body",))
        return body

    def _too_large(self) -> ServiceError:
        msg = f"request body is larger than {self.max_body_bytes} bytes (KP_MAX_BODY_BYTES)"
        return ServiceError(413, "body_too_large", msg, loc=("body",))


def caller_of(scope: Scope) -> Caller:
    """The caller Admission settled for this request (the default namespace outside it)."""
    found: Caller | None = scope.get("state", {}).get("caller")
    return found if found is not None else Caller(None, namespaces.DEFAULT)


def _key_in_query(query: bytes) -> str | None:
    for pair in query.decode("latin-1").replace(";", "&").split("&"):
        name = unquote_plus(pair.partition("=")[0], encoding="latin-1")
        # Every way of writing api_key is `apikey`: no case, no separators.
        if "".join(c for c in name.casefold() if c.isalnum()) in _KEY_PARAMS:
            return name
    return None


def _replaying(body: bytes, receive: Receive) -> Receive:
    """A receive that hands out `body` (already read) as the whole request, then defers to the
    real one (for the disconnect)."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
