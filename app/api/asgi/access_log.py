"""Request metrics and the access log line, whatever answered (a route or a refusal)."""

from __future__ import annotations

import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.core.metrics import Metrics

log = logging.getLogger("app.access")


class AccessLog:
    def __init__(self, app: ASGIApp, *, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_seen(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_seen)
        finally:
            elapsed = time.perf_counter() - started
            name = getattr(scope.get("route"), "path", "unmatched")
            m = self.metrics
            m.child(m.requests, name, scope["method"], str(status)).inc()
            m.child(m.latency, name).observe(elapsed)
            if status >= 400:
                m.child(m.errors, name, str(status)).inc()
            state = scope.get("state", {})
            key = state.get("api_key")
            namespace = state.get("namespace")  # a checked name: safe in a log line
            log.info(
                "request",
                extra={
                    "method": scope["method"],
                    "path": scope["path"],
                    "status": status,
                    "duration_ms": round(elapsed * 1000, 3),
                    **({"api_key": key.name} if key is not None else {}),
                    **({"namespace": namespace} if namespace is not None else {}),
                },
            )
