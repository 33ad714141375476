"""What the shared memory (app/memory/redis_vectors.py) says and reads besides its step: its
errors, the check that a Redis has vector search, the step's candidates rescored in float64,
and the words of an outage."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from redis.exceptions import RedisError, ResponseError

from app.core.config import config_error
from app.core.errors import PartError
from app.memory.base import Comparison, MemoryUnavailableError, NearestTrace, SearchMethod, Vector
from app.memory.ring import exact_cosine

#: A vector on the wire and in Redis: little-endian float32.
WIRE = np.dtype("<f4")


class SettingsMismatchError(PartError):
    """This replica's KP_CACHE_* or model differ from the namespace's in Redis."""


class NamespaceUnavailableError(MemoryUnavailableError):
    """This namespace cannot be used now (its index); the others can. Nothing was added."""


class QueryEngineMissingError(PartError):
    """The Redis at KP_REDIS_URL has no vector search."""


def refuse_without_query_engine(url: str, location: str, timeout_s: float = 5.0) -> None:
    """Before the server starts: a Redis that answers without vector search stops the start
    with one line (ConfigError); one that does not answer is left to the memory's outage
    handling (the service starts and says so)."""
    import redis

    try:
        with redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        ) as client:
            execute: Callable[..., Any] = client.execute_command  # untyped in redis-py
            try:
                execute("FT._LIST")
            except ResponseError as exc:
                if "unknown command" not in str(exc).lower():
                    return
                version = client.info("server").get("redis_version", "unknown")
                raise config_error("REDIS_URL", missing_query_engine(location, version)) from None
    except (RedisError, OSError):
        return


def missing_query_engine(location: str, version: str) -> str:
    return (
        f"the Redis at {location} (version {version}) has no vector search: the shared memory "
        "needs Redis 8 with its Query Engine, or Redis Stack 7.4"
    )


def number_text(value: float | None) -> str:
    if value is None:
        return "0"
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def rescored(
    queries: Sequence[Vector],
    trace_ids: Sequence[str],
    results: Sequence[Sequence[Any]],
    now: float,
    add: bool,
    capacity: int,
) -> list[Comparison]:
    """The script's candidates rescored in float64: each trace's nearest (ties: the newest).
    Without `add`, a trace is also compared with the call's earlier traces (newer than any
    stored entry, so they win ties)."""
    out = []
    for i, (query, result) in enumerate(zip(queries, results, strict=True)):
        size, method, count, *fields = result
        best: tuple[float, int, str, float] | None = None  # cosine, seq, trace, time
        for j in range(int(count)):
            seq, trace, t, data = fields[4 * j : 4 * j + 4]
            cosine = exact_cosine(query, np.frombuffer(data, dtype=WIRE))
            if best is None or (cosine, int(seq)) > (best[0], best[1]):
                best = (cosine, int(seq), text(trace), float(t))
        search: SearchMethod = "index" if method == b"index" else "exact"
        seen = int(size)
        if not add:
            for earlier in range(i):
                cosine = exact_cosine(query, queries[earlier])
                if best is None or cosine >= best[0]:
                    best = (cosine, 2**62, trace_ids[earlier], now)
            seen = min(capacity, seen + i)
        if best is None:
            out.append(Comparison(None, 0, stored=add))
            continue
        nearest = NearestTrace(best[2], best[0], max(0.0, now - best[3]))
        out.append(Comparison(best[0], seen, nearest, search, None, stored=add))
    return out


def describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "no answer within KP_REDIS_TIMEOUT_MS"
    text = str(exc)
    if isinstance(exc, SettingsMismatchError):
        return (
            f"{text}: give every replica the same settings, "
            "or DELETE /cache from one with the new ones"
        )
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
