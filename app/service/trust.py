"""Who may score and what a caller is owed, built from Settings: the API keys (with
KP_ADMIN_TOKEN), the signer of scores, the per-key rate limits and the idempotency records.
A bad keys or signing key file stops the start with ConfigError naming the variable."""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.core.config import Settings, config_error
from app.guards.api_keys import KeyFileError, KeyRing, load_key_file
from app.guards.idempotency import Idempotency, InProcessIdempotencyStore
from app.guards.rate_limit import InProcessRateLimiter, RateLimiter

if TYPE_CHECKING:
    import redis.asyncio as aioredis
    from joserfc.jwk import OKPKey

    from app.service.signing import Signer


def load_keys(settings: Settings) -> KeyRing:
    """The keys file's keys and KP_ADMIN_TOKEN; a bad file stops the start naming the entry."""
    entries = []
    if settings.api_keys_file is not None:
        try:
            entries = load_key_file(settings.api_keys_file)
        except KeyFileError as exc:
            raise config_error("API_KEYS_FILE", str(exc)) from None
    token = settings.admin_token
    return KeyRing(entries, token.get_secret_value() if token is not None else None)


def load_signer(settings: Settings) -> Signer | None:
    if settings.signing_key_file is None:
        if settings.signing_previous_keys_file is not None:
            raise config_error("SIGNING_PREVIOUS_KEYS_FILE", "is set without KP_SIGNING_KEY_FILE")
        return None
    # joserfc and cryptography load only when the service signs (they are slow to import).
    from app.service.signing import Signer, load_private_key, load_public_keys

    key = load_private_key(settings.signing_key_file)
    previous: tuple[OKPKey, ...] = ()
    if settings.signing_previous_keys_file is not None:
        previous = load_public_keys(settings.signing_previous_keys_file)
    return Signer(
        key,
        previous,
        settings.signing_issuer,
        settings.signing_audience,
        settings.signing_lifetime_s,
    )


def build_guards(settings: Settings) -> tuple[RateLimiter, Idempotency, aioredis.Redis | None]:
    """Rate limits and idempotency records: in this process, or in the Redis the novelty
    cache is shared through, so that every replica counts and replays alike; and their
    connection to that Redis (for the runtime to close)."""
    if settings.redis_url is None:
        return InProcessRateLimiter(), Idempotency(InProcessIdempotencyStore()), None
    # redis is slow to import; only here.
    import redis.asyncio as aioredis

    from app.guards.idempotency_redis import RedisIdempotencyStore
    from app.guards.rate_limit_redis import RedisRateLimiter

    client = aioredis.Redis.from_url(
        settings.redis_url.get_secret_value(),
        socket_timeout=settings.redis_timeout_ms / 1000,
        socket_connect_timeout=settings.redis_timeout_ms / 1000,
    )
    prefix = settings.redis_prefix
    records = Idempotency(RedisIdempotencyStore(client, prefix))
    return RedisRateLimiter(client, prefix), records, client
