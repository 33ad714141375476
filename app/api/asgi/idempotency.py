"""Idempotency-Key on the scoring routes, after the body is read (the key covers it) and
before the route parses it: a replay, a 422 for another request under the key, a 409 for a copy
that waited too long for the first, else the request runs and its answer is recorded."""

from __future__ import annotations

import logging
import re

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.asgi.base import detail, read_replayed, replaying, send_json
from app.api.asgi.namespaces import namespace_of
from app.core.metrics import Metrics
from app.guards.api_keys import ApiKey
from app.guards.idempotency import IdempotencyUnavailableError, Recorded
from app.guards.idempotency_keys import Idempotency, fingerprint, scoped_key

log = logging.getLogger(__name__)

ROUTES = ("/evaluate", "/evaluate/batch", "/contribution")
#: The longest key taken (Stripe's bound); a UUID or a hex SHA-256 fit well within it.
MAX_KEY_CHARS = 255
#: The whole rule, as the OpenAPI document states it (app/api/openapi_doc.py): 1 to 255
#: visible ASCII characters, quotes included, and not `""` (the draft's structured-field
#: string "..." is taken, its content being the key: it must not be empty).
KEY_PATTERN = f'^(?!""$)[!-~]{{1,{MAX_KEY_CHARS}}}$'
_KEY = re.compile(KEY_PATTERN)
REPLAY_HEADER = b"idempotent-replayed"
_LOC = ("header", "idempotency-key")


def parse_key(value: str) -> str | None:
    """The key, or None when it breaks KEY_PATTERN. The draft makes it a structured-field
    string ("..."); a bare token is taken too."""
    if not _KEY.fullmatch(value):
        return None
    if len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    return value


class IdempotencyKeys:
    def __init__(self, app: ASGIApp, *, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = Headers(scope=scope).get("idempotency-key") if scope["type"] == "http" else None
        if given is None or scope["method"] != "POST" or scope["path"] not in ROUTES:
            await self.app(scope, receive, send)
            return
        key = parse_key(given.strip())
        if key is None:
            msg = f"must be 1 to {MAX_KEY_CHARS} visible ASCII characters"
            await send_json(send, 400, detail(_LOC, msg, "idempotency_key_invalid"))
            return
        principal: ApiKey | None = scope.get("state", {}).get("api_key")
        idempotency: Idempotency = scope["app"].state.services.idempotency
        body = await read_replayed(receive)
        scoped = scoped_key(principal.name if principal else None, namespace_of(scope), key)
        print_ = fingerprint(scope["method"], scope["path"], scope.get("query_string", b""), body)
        try:
            decision = await idempotency.begin(scoped, print_)
        except IdempotencyUnavailableError as exc:
            await self._unavailable(send, exc)
            return
        self.metrics.child(self.metrics.idempotency, decision.action).inc()
        if decision.action == "mismatch":
            msg = "this Idempotency-Key was used for another request (body or query)"
            await send_json(send, 422, detail(_LOC, msg, "idempotency_key_reused"))
            return
        if decision.action == "in_progress":
            msg = "a request with this Idempotency-Key is still being answered: retry later"
            await send_json(
                send, 409, detail(_LOC, msg, "idempotency_key_in_use"), [(b"retry-after", b"1")]
            )
            return
        if decision.action == "replay":
            assert decision.recorded is not None
            await _replay(send, decision.recorded)
            return
        await self._run(scope, replaying(body, receive), send, idempotency, scoped, print_)

    async def _run(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        idempotency: Idempotency,
        scoped: str,
        print_: str,
    ) -> None:
        status = 0
        content_type = b"application/json"
        chunks: list[bytes] = []

        async def send_kept(message: Message) -> None:
            nonlocal status, content_type
            if message["type"] == "http.response.start":
                status = message["status"]
                for name, value in message.get("headers", []):
                    if name.lower() == b"content-type":
                        content_type = value
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
            await send(message)

        answer = None
        try:
            await self.app(scope, receive, send_kept)
            answer = Recorded(status, content_type, b"".join(chunks))
        finally:
            try:
                await idempotency.finish(scoped, print_, answer)
            except IdempotencyUnavailableError as exc:
                # The answer is sent: a retry will be scored again (and say it in the log).
                log.error("idempotency record not kept", extra={"reason": str(exc)})

    async def _unavailable(self, send: Send, exc: IdempotencyUnavailableError) -> None:
        log.error("idempotency records unavailable", extra={"reason": str(exc)})
        msg = "idempotency records are unavailable (Redis): nothing was scored, retry"
        await send_json(
            send, 503, detail(_LOC, msg, "idempotency_unavailable"), [(b"retry-after", b"1")]
        )


async def _replay(send: Send, answer: Recorded) -> None:
    headers = [
        (b"content-type", answer.content_type),
        (b"content-length", b"%d" % len(answer.body)),
        (REPLAY_HEADER, b"true"),
    ]
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body, "more_body": False})
