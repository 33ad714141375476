"""415 for a request body that is not JSON, before it is read."""

from __future__ import annotations

import re

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from app.api.asgi.base import detail, send_json

_JSON_TYPE = re.compile(r"^application/([a-z0-9.+-]*\+)?json\s*(;.*)?$", re.IGNORECASE)
BODY_METHODS = ("POST", "PUT", "PATCH")
#: Bodies read as a stream by their route, which applies its own type and limits
#: (POST /cache/import: NDJSON, KP_CACHE_IMPORT_MAX_BYTES).
STREAMED = frozenset({"/cache/import"})


def has_json_body(scope: Scope) -> bool:
    """Whether the pieces read and check this request's body as JSON."""
    return scope["method"] in BODY_METHODS and scope["path"] not in STREAMED


class ContentType:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        content_type = Headers(scope=scope).get("content-type") if scope["type"] == "http" else None
        if content_type is not None and has_json_body(scope) and not _JSON_TYPE.match(content_type):
            body = detail(
                ("header", "content-type"),
                f"must be application/json, got {content_type!r}",
                "unsupported_media_type",
            )
            await send_json(send, 415, body)
            return
        await self.app(scope, receive, send)
