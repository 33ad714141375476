"""Per-key token buckets (rate_per_minute of the keys file): in this process, or shared by
every replica through Redis (KP_REDIS_URL, rate_limit_redis.py), so the limit holds however
requests are spread. A bucket holds `per_minute` tokens (a whole minute's worth may come at
once) and refills at `per_minute` a minute; a request takes one (a batch, one per trace) or is
told how long until they are there."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Protocol

from app.core.errors import PartError


class RateLimitUnavailableError(PartError):
    """The shared buckets cannot be reached."""


class RateLimiter(Protocol):
    async def take(self, name: str, per_minute: int, cost: int = 1) -> float:
        """0 when a request of `name` costing `cost` tokens may go now (they are taken), else
        the seconds until it may (nothing is taken)."""
        ...


class InProcessRateLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}

    async def take(self, name: str, per_minute: int, cost: int = 1) -> float:
        now = self._clock()
        tokens, at = self._buckets.get(name, (float(per_minute), now))
        tokens = min(float(per_minute), tokens + (now - at) * per_minute / 60.0)
        if tokens >= cost:
            self._buckets[name] = (tokens - cost, now)
            return 0.0
        self._buckets[name] = (tokens, now)
        return (cost - tokens) * 60.0 / per_minute


def retry_after(seconds: float) -> int:
    """Retry-After is whole seconds: rounded up, so a client that waits that long is served."""
    return max(1, math.ceil(seconds))
