"""Idempotency records (the IETF Idempotency-Key draft): for each key, who holds it while the
first request with it is being answered, then that answer, kept for a day. In this process, or
in Redis (KP_REDIS_URL, idempotency_redis.py) so that a retry sent to another replica finds the
first answer."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal, Protocol

#: How long an answer is replayed (the reference registry's window).
RECORD_TTL_S = 24 * 3600
#: A claim is a lease this long, renewed every CLAIM_RENEW_S by its holder while it answers:
#: when the holder dies (a replica's crash) or cannot reach the records (Redis's crash, its
#: claim restored from the AOF), the key is free again within this, and a retry runs instead
#: of waiting for a claim no one will finish.
CLAIM_TTL_S = 3
CLAIM_RENEW_S = 1.0


class IdempotencyUnavailableError(Exception):
    """The shared records cannot be reached."""


@dataclass(frozen=True, slots=True)
class Recorded:
    """An answer as it was sent: replayed byte for byte."""

    status: int
    content_type: bytes
    body: bytes


@dataclass(frozen=True, slots=True)
class Claim:
    """`claimed`: the caller holds the key now; `pending`: another request holds it;
    `done`: its answer is recorded. `fingerprint`: of the request that claimed the key."""

    state: Literal["claimed", "pending", "done"]
    fingerprint: str
    recorded: Recorded | None = None


class IdempotencyStore(Protocol):
    async def claim(self, key: str, fingerprint: str) -> Claim: ...

    async def record(self, key: str, fingerprint: str, answer: Recorded) -> None: ...

    async def release(self, key: str) -> None: ...

    async def renew(self, key: str, fingerprint: str) -> None:
        """Extends the caller's claim on `key` by CLAIM_TTL_S (nothing if it is not pending)."""
        ...


class InProcessIdempotencyStore:
    """At most `capacity` keys (the oldest go first): a bound on memory, as Redis's is its own."""

    def __init__(self, capacity: int = 10_000) -> None:
        self._capacity = capacity
        self._entries: OrderedDict[str, tuple[float, Claim]] = OrderedDict()

    def _live(self, key: str) -> Claim | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        expires, claim = entry
        if expires <= time.monotonic():
            del self._entries[key]
            return None
        return claim

    def _put(self, key: str, claim: Claim, ttl_s: float) -> None:
        self._entries[key] = (time.monotonic() + ttl_s, claim)
        self._entries.move_to_end(key)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    async def claim(self, key: str, fingerprint: str) -> Claim:
        found = self._live(key)
        if found is not None:
            return found if found.state == "done" else Claim("pending", found.fingerprint)
        self._put(key, Claim("pending", fingerprint), CLAIM_TTL_S)
        return Claim("claimed", fingerprint)

    async def record(self, key: str, fingerprint: str, answer: Recorded) -> None:
        self._put(key, Claim("done", fingerprint, answer), RECORD_TTL_S)

    async def release(self, key: str) -> None:
        self._entries.pop(key, None)

    async def renew(self, key: str, fingerprint: str) -> None:
        found = self._live(key)
        if found is not None and found.state == "pending" and found.fingerprint == fingerprint:
            self._put(key, found, CLAIM_TTL_S)
