"""Retries that count once (the IETF Idempotency-Key draft; the rules and why:
docs/decisions/idempotency-key.md). The first request with a key holds it by a short lease it
renews while it answers, so a holder that died frees the key within seconds. The records live
in this process, or in Redis (KP_REDIS_URL, idempotency_redis.py) so that a retry sent to
another replica finds the first answer."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal, Protocol

from app.core.errors import PartError

#: The longest key taken (Stripe's bound); a UUID or a hex SHA-256 fit well within it.
MAX_KEY_CHARS = 255
#: The whole rule, as the OpenAPI document states it: 1 to 255 visible ASCII characters,
#: quotes included, and not `""` (the draft's structured-field string "..." is taken, its
#: content being the key: it must not be empty).
KEY_PATTERN = f'^(?!""$)[!-~]{{1,{MAX_KEY_CHARS}}}$'
_KEY = re.compile(KEY_PATTERN)


def parse_key(value: str) -> str | None:
    """The key, or None when it breaks KEY_PATTERN. The draft makes it a structured-field
    string ("..."); a bare token is taken too."""
    value = value.strip()
    if not _KEY.fullmatch(value):
        return None
    if len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    return value


#: How long an answer is replayed (the reference registry's window).
RECORD_TTL_S = 24 * 3600
#: A claim is a lease this long, renewed every CLAIM_RENEW_S by its holder while it answers:
#: when the holder dies (a replica's crash) or cannot reach the records (Redis's crash, its
#: claim restored from the AOF), the key is free again within this, and a retry runs instead
#: of waiting for a claim no one will finish.
CLAIM_TTL_S = 3
CLAIM_RENEW_S = 1.0


class IdempotencyUnavailableError(PartError):
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
        expires, claim = self._entries.get(key, (0.0, None))
        if claim is not None and expires <= time.monotonic():
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


#: Longest a copy waits for the first request with its key: past any answer the service gives
#: (KP_EMBED_MAX_WAIT_MS turns model waits away at 10 s by default).
WAIT_S = 30.0
_POLL_S = 0.02


@dataclass(frozen=True, slots=True)
class Decision:
    """`run`: answer the request and record it; `replay`: send `recorded`; `mismatch`: the key
    was used for another request; `in_progress`: the first is still being answered."""

    action: Literal["run", "replay", "mismatch", "in_progress"]
    recorded: Recorded | None = None


def scoped_key(principal: str | None, namespace: str, key: str) -> str:
    """Keys are scoped to the API key that sent them (two agents may pick the same key) and to
    the namespace (the same key in two namespaces is two requests)."""
    return hashlib.sha256(f"{principal or ''}\0{namespace}\0{key}".encode()).hexdigest()


def fingerprint(method: str, path: str, query: bytes, body: bytes) -> str:
    digest = hashlib.sha256()
    for part in (method.encode(), path.encode(), query, body):
        digest.update(b"%d:" % len(part))
        digest.update(part)
    return digest.hexdigest()


class Idempotency:
    def __init__(self, store: IdempotencyStore) -> None:
        self.store = store
        self._leases: dict[str, asyncio.Task[None]] = {}  # claims held, renewed until finish

    async def begin(self, key: str, print_: str) -> Decision:
        """A `run` decision holds the key (its claim renewed) until `finish`."""
        deadline = time.monotonic() + WAIT_S
        while True:
            claim = await self.store.claim(key, print_)
            if claim.state == "claimed":
                self._leases[key] = asyncio.create_task(self._hold(key, print_))
                return Decision("run")
            if claim.fingerprint != print_:
                return Decision("mismatch")
            if claim.state == "done":
                return Decision("replay", claim.recorded)
            # The same request, still being answered: wait.
            if time.monotonic() >= deadline:
                return Decision("in_progress")
            await asyncio.sleep(_POLL_S)

    async def _hold(self, key: str, print_: str) -> None:
        while True:
            await asyncio.sleep(CLAIM_RENEW_S)
            # Unreachable records: the claim lapses, as a dead holder's would.
            with contextlib.suppress(IdempotencyUnavailableError):
                await self.store.renew(key, print_)

    async def finish(self, key: str, print_: str, answer: Recorded | None) -> None:
        """Records a successful answer; anything else frees the key for a retry."""
        lease = self._leases.pop(key, None)
        if lease is not None:
            lease.cancel()
        if answer is not None and 200 <= answer.status < 300:
            await self.store.record(key, print_, answer)
        else:
            await self.store.release(key)
