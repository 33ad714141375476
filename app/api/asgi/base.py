"""What the pipeline's pieces share: a JSON answer, body replay, the request's state."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import orjson
from starlette.types import Message, Receive, Send

from app.core.errors import error_body, field_error


def detail(loc: tuple[str, ...], msg: str, kind: str) -> dict[str, Any]:
    """The one error shape (app/core/errors.py), with one entry naming the part at fault."""
    return error_body([field_error(loc, msg, kind)])


async def send_json(
    send: Send, status: int, body: Any, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    payload = orjson.dumps(body)
    start = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload))]
    await send(
        {"type": "http.response.start", "status": status, "headers": start + (headers or [])}
    )
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def replaying(body: bytes, receive: Receive) -> Receive:
    """A receive that hands out `body` (already read) as the whole request, then defers to
    the real one (for the disconnect)."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def read_replayed(receive: Receive) -> bytes:
    """The body a `replaying` receive holds (one message), for pieces after the body limit."""
    message = await receive()
    data: bytes = message.get("body", b"")
    return data


def state(scope: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """The request's state (Starlette's `request.state` reads the same mapping)."""
    found: MutableMapping[str, Any] = scope.setdefault("state", {})
    return found
