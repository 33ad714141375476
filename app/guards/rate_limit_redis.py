"""The rate limit's token buckets in Redis, shared by every replica (KP_REDIS_URL)."""

from __future__ import annotations

from importlib.resources import files

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from app.guards.rate_limit import RateLimitUnavailableError


class RedisRateLimiter:
    """The buckets in Redis, one hash per key name, taken by a Lua script (atomic)."""

    def __init__(self, client: aioredis.Redis, prefix: str) -> None:
        self._client = client
        self._prefix = prefix
        source = files("app.guards").joinpath("token_bucket.lua").read_text(encoding="utf-8")
        self._script = client.register_script(source)

    async def take(self, name: str, per_minute: int, cost: int = 1) -> float:
        try:
            wait_us = await self._script(
                keys=[f"{self._prefix}ratelimit:{name}"], args=[per_minute, cost]
            )
        except (RedisError, OSError) as exc:
            raise RateLimitUnavailableError(f"{type(exc).__name__}: {exc}") from exc
        return int(wait_us) / 1e6
