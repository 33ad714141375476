"""Retries that count once (the IETF Idempotency-Key draft): the first request with a key is
answered and its answer recorded; the same key with the same request within a day gets that
answer again, and adds nothing; with another request, a 422; while the first is still being
answered, a copy waits for it (and gets 409 if it waits too long). The first holds the key by a
short lease it renews while it answers (app/guards/idempotency.py), so a holder that died frees
the key within seconds."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from dataclasses import dataclass
from typing import Literal

from app.guards.idempotency import (
    CLAIM_RENEW_S,
    Claim,
    IdempotencyStore,
    IdempotencyUnavailableError,
    Recorded,
)

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
    def __init__(self, store: IdempotencyStore, *, wait_s: float = WAIT_S) -> None:
        self.store = store
        self.wait_s = wait_s
        self._leases: dict[str, asyncio.Task[None]] = {}  # claims held, renewed until finish

    async def begin(self, key: str, print_: str) -> Decision:
        """A `run` decision holds the key (its claim renewed) until `finish`."""
        deadline = time.monotonic() + self.wait_s
        while True:
            claim = await self.store.claim(key, print_)
            decision = _decide(claim, print_)
            if decision is not None:
                if decision.action == "run":
                    self._leases[key] = asyncio.create_task(self._hold(key, print_))
                return decision
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


def _decide(claim: Claim, print_: str) -> Decision | None:
    if claim.fingerprint != print_ and claim.state != "claimed":
        return Decision("mismatch")
    if claim.state == "claimed":
        return Decision("run")
    if claim.state == "done":
        return Decision("replay", claim.recorded)
    return None  # the same request, still being answered: wait
