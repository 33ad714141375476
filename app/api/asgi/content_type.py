"""415 for a request body that is not JSON, before it is read."""

from __future__ import annotations

import re

from app.api.asgi.base import ASGIApp, Receive, Scope, Send, detail, header, send_json

_JSON_TYPE = re.compile(r"^application/([a-z0-9.+-]*\+)?json\s*(;.*)?$", re.IGNORECASE)
BODY_METHODS = ("POST", "PUT", "PATCH")


class ContentType:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        content_type = header(scope, b"content-type") if scope["type"] == "http" else None
        if (
            content_type is not None
            and scope["method"] in BODY_METHODS
            and not _JSON_TYPE.match(content_type)
        ):
            body = detail(
                ("header", "content-type"),
                f"must be application/json, got {content_type!r}",
                "unsupported_media_type",
            )
            await send_json(send, 415, body)
            return
        await self.app(scope, receive, send)
