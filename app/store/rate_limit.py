"""Per-key token buckets (rate_per_minute of the keys file): in this process, or shared by
every replica through Redis (KP_REDIS_URL), so the limit holds however requests are spread.

A bucket holds `per_minute` tokens (a whole minute's worth may come at once) and refills at
`per_minute` a minute; a request takes one or is told how long until one is there.
"""

from __future__ import annotations

import math
import time
from importlib.resources import files
from typing import Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError


class RateLimitUnavailableError(Exception):
    """The shared buckets cannot be reached."""


class RateLimiter(Protocol):
    async def take(self, name: str, per_minute: int) -> float:
        """0 when a request of `name` may go now, else the seconds until it may."""
        ...


class InProcessRateLimiter:
    def __init__(self) -> None:
        self._buckets: dict[str, tuple[float, float]] = {}

    async def take(self, name: str, per_minute: int) -> float:
        now = time.monotonic()
        tokens, at = self._buckets.get(name, (float(per_minute), now))
        tokens = min(float(per_minute), tokens + (now - at) * per_minute / 60.0)
        if tokens >= 1:
            self._buckets[name] = (tokens - 1, now)
            return 0.0
        self._buckets[name] = (tokens, now)
        return (1 - tokens) * 60.0 / per_minute


class RedisRateLimiter:
    """The buckets in Redis, one hash per key name, taken by a Lua script (atomic)."""

    def __init__(self, client: aioredis.Redis, prefix: str) -> None:
        self._client = client
        self._prefix = prefix
        source = files("app.store").joinpath("token_bucket.lua").read_text(encoding="utf-8")
        self._script = client.register_script(source)

    async def take(self, name: str, per_minute: int) -> float:
        try:
            wait_us = await self._script(
                keys=[f"{self._prefix}ratelimit:{name}"], args=[per_minute]
            )
        except (RedisError, OSError) as exc:
            raise RateLimitUnavailableError(f"{type(exc).__name__}: {exc}") from exc
        return int(wait_us) / 1e6


def retry_after(seconds: float) -> int:
    """Retry-After is whole seconds: rounded up, so a client that waits that long is served."""
    return max(1, math.ceil(seconds))
