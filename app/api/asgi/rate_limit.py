"""Per-key rate limits, before the body is read: past its bucket a key gets 429 with
Retry-After, and the request costs a header lookup and one bucket check. A request without a
key (scoring left open) or from a key without `rate_per_minute` is not limited."""

from __future__ import annotations

import logging

from starlette.types import ASGIApp, Receive, Scope, Send

from app.api.asgi.base import detail, send_json
from app.core.metrics import Metrics
from app.guards.api_keys import ApiKey
from app.guards.rate_limit import RateLimiter, RateLimitUnavailableError, retry_after

log = logging.getLogger(__name__)


class RateLimit:
    def __init__(self, app: ASGIApp, *, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key: ApiKey | None = (
            scope.get("state", {}).get("api_key") if scope["type"] == "http" else None
        )
        if key is None:
            await self.app(scope, receive, send)
            return
        if key.rate_per_minute is None:
            self.metrics.child(self.metrics.key_requests, key.name, "admitted").inc()
            await self.app(scope, receive, send)
            return
        limiter: RateLimiter = scope["app"].state.services.rate_limiter
        try:
            wait = await limiter.take(key.name, key.rate_per_minute)
        except RateLimitUnavailableError as exc:
            # Fails open, visibly: refusing every agent because Redis is away would be worse.
            self.metrics.rate_limit_unavailable.inc()
            log.warning("rate limit not checked: Redis unavailable", extra={"reason": str(exc)})
            wait = 0.0
        if wait > 0:
            self.metrics.child(self.metrics.key_requests, key.name, "rate_limited").inc()
            seconds = retry_after(wait)
            msg = (
                f"the API key {key.name!r} is over its rate of {key.rate_per_minute} requests "
                f"a minute: retry after {seconds} s"
            )
            await send_json(
                send,
                429,
                detail(("header", "authorization"), msg, "rate_limited"),
                [(b"retry-after", str(seconds).encode())],
            )
            return
        self.metrics.child(self.metrics.key_requests, key.name, "admitted").inc()
        await self.app(scope, receive, send)
