"""Idempotency records in Redis, shared by every replica (KP_REDIS_URL)."""

from __future__ import annotations

import base64

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from app.guards.idempotency import (
    CLAIM_TTL_S,
    RECORD_TTL_S,
    Claim,
    IdempotencyUnavailableError,
    Recorded,
)

#: Extends a claim only while it is still the pending one (not an answer recorded since).
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('EXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


class RedisIdempotencyStore:
    """A string per key: a claim (SET NX, expiring) replaced by the answer (expiring a day on)."""

    def __init__(self, client: aioredis.Redis, prefix: str) -> None:
        self._client = client
        self._prefix = f"{prefix}idempotency:"
        self._renew = client.register_script(_RENEW)

    async def claim(self, key: str, fingerprint: str) -> Claim:
        name = self._prefix + key
        pending = orjson.dumps({"state": "pending", "fp": fingerprint})
        try:
            while True:
                if await self._client.set(name, pending, nx=True, ex=CLAIM_TTL_S):
                    return Claim("claimed", fingerprint)
                raw = await self._client.get(name)
                if raw is not None:
                    return _parse(raw)
                # Expired between the two commands: claim again.
        except (RedisError, OSError) as exc:
            raise IdempotencyUnavailableError(f"{type(exc).__name__}: {exc}") from exc

    async def record(self, key: str, fingerprint: str, answer: Recorded) -> None:
        value = orjson.dumps(
            {
                "state": "done",
                "fp": fingerprint,
                "status": answer.status,
                "content_type": answer.content_type.decode("latin-1"),
                "body": base64.b64encode(answer.body).decode("ascii"),
            }
        )
        try:
            await self._client.set(self._prefix + key, value, ex=RECORD_TTL_S)
        except (RedisError, OSError) as exc:
            raise IdempotencyUnavailableError(f"{type(exc).__name__}: {exc}") from exc

    async def renew(self, key: str, fingerprint: str) -> None:
        pending = orjson.dumps({"state": "pending", "fp": fingerprint})
        try:
            await self._renew(keys=[self._prefix + key], args=[pending, CLAIM_TTL_S])
        except (RedisError, OSError) as exc:
            raise IdempotencyUnavailableError(f"{type(exc).__name__}: {exc}") from exc

    async def release(self, key: str) -> None:
        try:
            await self._client.delete(self._prefix + key)
        except (RedisError, OSError) as exc:
            raise IdempotencyUnavailableError(f"{type(exc).__name__}: {exc}") from exc


def _parse(raw: bytes | str) -> Claim:
    data = orjson.loads(raw)
    if data["state"] != "done":
        return Claim("pending", data["fp"])
    answer = Recorded(
        data["status"], data["content_type"].encode("latin-1"), base64.b64decode(data["body"])
    )
    return Claim("done", data["fp"], answer)
