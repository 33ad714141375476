"""A batch costs one rate-limit token per trace, as the same traces sent one by one would: the
request's first token is taken before its body is read (app/api/asgi/rate_limit.py), the
others here, once the traces are counted and before any is scored. A batch refused here (422:
more traces than the key's bucket holds; 429: not enough tokens now) spends nothing: its
first token is given back, as a request refused before its body spends none."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from app.core.errors import field_error
from app.guards.api_keys import ApiKey
from app.guards.rate_limit import RateLimiter, RateLimitUnavailableError, retry_after

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Refusal:
    status: int  # 429: retry after `retry_after_s`; 422: never fits the key's bucket
    error: dict[str, Any]
    retry_after_s: int | None = None


async def charge_batch(
    limiter: RateLimiter, key: ApiKey | None, traces: int, at: tuple[str | int, ...]
) -> Refusal | None:
    """Takes the tokens of a batch's traces after its first; None when they were there."""
    if key is None or key.rate_per_minute is None or traces <= 1:
        return None
    rate = key.rate_per_minute
    if traces > rate:
        msg = (
            f"at most {rate} traces a batch for the API key {key.name!r} (its rate per minute: "
            "a batch costs one token per trace)"
        )
        await _give_back_first(limiter, key.name, rate)
        return Refusal(422, field_error((*at, "traces"), msg, "batch_over_rate"))
    try:
        wait = await limiter.take(key.name, rate, traces - 1)
    except RateLimitUnavailableError as exc:
        log.warning("rate limit not checked: Redis unavailable", extra={"reason": str(exc)})
        return None
    if wait <= 0:
        return None
    await _give_back_first(limiter, key.name, rate)
    seconds = retry_after(wait)
    msg = (
        f"the API key {key.name!r} is over its rate of {rate} traces a minute (a batch of "
        f"{traces} costs {traces}): retry after {seconds} s"
    )
    return Refusal(429, field_error(("header", "authorization"), msg, "rate_limited"), seconds)


async def _give_back_first(limiter: RateLimiter, name: str, rate: int) -> None:
    """Returns the token the request paid before its body was read. A negative cost adds to
    the bucket (both buckets clamp at their capacity as they refill). Should the shared
    buckets have gone away since, the token stays spent: the limit errs on the strict side."""
    with contextlib.suppress(RateLimitUnavailableError):
        await limiter.take(name, rate, -1)
