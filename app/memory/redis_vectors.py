"""The shared novelty memory (KP_REDIS_URL): kept once, in Redis, and searched there by Redis's
Query Engine; replicas hold no copy. A namespace's keys and indexes carry its name as a hash tag
(one node holds them all, on a Redis Cluster too), and a request's searches and adds are one
run of memory.lua there: Redis runs it alone, so each namespace has one order for every
replica. FLAT up to KP_REDIS_HNSW_FROM entries ("exact": the candidates are rescored here in
float64), HNSW past it ("index"). Why: docs/operating/scaling.md and docs/decisions/
memory-step-in-lua.md, flat-then-hnsw.md, shared-namespace-health.md.

Redis down: MemoryUnavailableError at once (nothing added), one log line for the outage and one
for its end, a probe every RETRY_INTERVAL_S; no request waits longer than KP_REDIS_TIMEOUT_MS
(one that timed out after the script ran has its entries stored although its answer said
cache_unavailable). A namespace whose index went or is not this memory's is refused alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from importlib import resources
from typing import Any

import numpy as np
from redis.asyncio import Redis, RedisCluster
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError
from redis.retry import Retry

from app.core.config import config_error
from app.core.health import UNMEASURED, Health
from app.memory.base import (
    DEFAULT_NAMESPACE,
    RECEIPT_TTL_MS,
    BackendInfo,
    Comparison,
    MemoryFaults,
    MemoryUnavailableError,
    NamespaceLimitError,
    Vector,
)
from app.memory.redis_parts import (
    WIRE,
    NamespaceUnavailableError,
    QueryEngineMissingError,
    SettingsMismatchError,
    describe,
    missing_query_engine,
    number_text,
    rescored,
    text,
)
from app.memory.ring import CacheEntries, CacheStats

log = logging.getLogger(__name__)

RETRY_INTERVAL_S = 0.5
#: How often a replica reads Redis's maxmemory-policy, tries the namespaces it refuses again,
#: and (one replica at a time) lets go of expired namespaces.
WATCH_INTERVAL_S = 2.0
#: Namespaces whose expiry is looked at concurrently while the registry is swept.
SWEEP_CONCURRENCY = 32
#: Entries one run of an import appends, and one read of an export returns (about 1.5 MB).
BATCH = 1000
#: How long one bulk run (an import's batch, an export's page, a clear) may take: an
#: operator's work, not a request's, so not bound by KP_REDIS_TIMEOUT_MS.
BULK_TIMEOUT_S = 30.0
#: Candidates a search returns at first; the exact path widens past it when more are tied.
CANDIDATES = 8

#: Adds the namespace to the set of namespaces unless that would pass the limit.
_REGISTER = """
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return 1 end
if redis.call('SCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('SADD', KEYS[1], ARGV[1])
return 1
"""


class RedisVectorMemory:
    """The novelty memory of every replica on one Redis (or Redis Cluster) and prefix, one
    memory per namespace (the module's docstring says how each keeps one order)."""

    def __init__(
        self,
        url: str,
        location: str,
        *,
        prefix: str,
        capacity: int,
        ttl_ms: float | None,
        timeout_ms: float,
        model: str | None,
        dimensions: int = 384,
        max_namespaces: int = 1000,
        hnsw_from: int = 10_000,
        hnsw_m: int = 16,
        hnsw_ef_construction: int = 200,
        hnsw_ef_runtime: int = 800,
    ) -> None:
        if "{" in prefix or "}" in prefix:
            raise ValueError("the key prefix may not hold braces (they make hash tags)")
        self.url = url
        self.location = location
        self.prefix = prefix
        self.capacity = capacity
        self.ttl_ms = ttl_ms
        self.model = model or ""
        self.max_namespaces = max_namespaces
        self.dimensions = dimensions
        self._timeout_s = timeout_ms / 1000.0
        numbers = (dimensions, hnsw_from, hnsw_m, hnsw_ef_construction, hnsw_ef_runtime, CANDIDATES)
        self._settings = [str(capacity), number_text(ttl_ms), self.model, *map(str, numbers)]
        self._script_text = (resources.files("app.memory") / "memory.lua").read_text("utf-8")
        self._client: Redis | RedisCluster | None = None
        # Clients dropped at an outage: their pooled connections may be dead (a restarted
        # Redis closed them), so the probe connects anew and closes these.
        self._stale: list[Redis | RedisCluster] = []
        self._connecting = asyncio.Lock()
        self._script: Any = None
        self._register: Any = None
        self._registry = f"{prefix}namespaces"
        self._known: set[str] = set()  # namespaces this replica registered
        self._sizes: dict[str, int] = {}  # entries per namespace as last seen
        self._evictions: dict[str, int] = {}
        self._last_stats: dict[str, CacheStats] = {}  # GET /cache's answer while unavailable
        self._available = True
        self._reason = ""
        self._outages_total = 0
        self._outage_started = 0.0
        self._unmeasured_in_outage = 0
        self._probe: asyncio.Task[None] | None = None
        self._mismatched: str | None = None  # a namespace whose settings differ from these
        self._closed = False
        self._faults: dict[str, str] = {}  # namespaces refused now, and why
        self._notes: dict[str, str] = {}  # namespaces answered by FLAT: the HNSW's name taken
        self._verified: set[str] = set()  # namespaces whose index this process checked
        self._index_rebuilds_total = 0
        self._eviction: str | None = None  # why nothing is stored: the maxmemory-policy
        self._policy_unread: str | None = None  # why the policy could not be read
        self._not_stored_total = 0
        self._retired_evictions = 0  # evictions of the namespaces let go
        self._watch: asyncio.Task[None] | None = None
        # No registered namespace can expire before this (time.monotonic()), as of the last
        # sweep: a new namespace past the limit sweeps only from then on.
        self._no_expiry_before = 0.0
        self._sweeping = asyncio.Lock()

    # ── what operators see ──────────────────────────────────────────────────

    @property
    def backend(self) -> BackendInfo:
        return BackendInfo(
            "redis",
            True,
            self.location,
            self.prefix,
            self._available,
            None if self._available else self._reason,
            self._outages_total,
        )

    @property
    def size(self) -> int:
        return sum(self._sizes.values())

    @property
    def evictions_total(self) -> int:
        return self._retired_evictions + sum(self._evictions.values())

    @property
    def faults(self) -> MemoryFaults:
        return MemoryFaults(
            namespaces_unavailable=len(self._faults),
            index_rebuilds_total=self._index_rebuilds_total,
            eviction_unsafe=self._eviction is not None,
            not_stored_total=self._not_stored_total,
        )

    def health(self) -> Health:
        warnings: list[str] = []
        if not self._available:
            warnings.append(UNMEASURED + self._unavailable_detail())
        faults = sorted(self._faults.items())
        warnings += [UNMEASURED + f"namespace {ns!r}: {why}" for ns, why in faults[:10]]
        if len(faults) > 10:
            warnings.append(UNMEASURED + f"and {len(faults) - 10} more namespaces (the log)")
        if self._eviction is not None:
            warnings.append(f"traces are scored but not stored: {self._eviction}")
        if self._policy_unread is not None:
            warnings.append(self._policy_unread)
        warnings += [f"namespace {ns!r}: {note}" for ns, note in sorted(self._notes.items())[:10]]
        return Health(degraded=not self._available or bool(faults), warnings=tuple(warnings))

    # ── lifecycle ───────────────────────────────────────────────────────────

    async def start(self) -> None:
        """Connects. A Redis that answers without vector search stops the start (ConfigError,
        one line); a Redis that does not answer is an outage, reported, not fatal."""
        try:
            await self._connect()
        except QueryEngineMissingError as exc:
            raise config_error("REDIS_URL", str(exc)) from None
        except (RedisError, OSError, TimeoutError) as exc:
            self._went_down(exc)
        self._watch = asyncio.get_running_loop().create_task(self._watch_while_serving())
        if not self._available:
            return
        # Other settings than the default namespace's are reported now, not at a first trace.
        with contextlib.suppress(MemoryUnavailableError):
            await self._run(DEFAULT_NAMESPACE, "step", ["0", "", "0"], bulk=False)

    async def _connect(self) -> None:
        options: dict[str, Any] = {
            "socket_timeout": max(self._timeout_s, BULK_TIMEOUT_S),
            "socket_connect_timeout": self._timeout_s,
            "retry": Retry(NoBackoff(), 0),
            "client_name": "kp-scoring",
        }
        seed = Redis.from_url(self.url, **options)
        execute: Callable[..., Awaitable[Any]] = seed.execute_command  # untyped in redis-py
        try:
            async with asyncio.timeout(max(self._timeout_s, 5.0)):
                try:
                    await execute("FT._LIST")
                except ResponseError as exc:
                    if "unknown command" not in str(exc).lower():
                        raise
                    version = (await seed.info("server")).get("redis_version", "unknown")
                    missing = missing_query_engine(self.location, version)
                    raise QueryEngineMissingError(missing) from None
                cluster = (await seed.info("cluster")).get("cluster_enabled") == 1
        except BaseException:
            await seed.aclose()
            raise
        client: Redis | RedisCluster = seed
        if cluster:
            await seed.aclose()
            client = RedisCluster.from_url(self.url, **options)
            async with asyncio.timeout(max(self._timeout_s, 5.0)):
                await client.initialize()
        self._client = client
        self._script = client.register_script(self._script_text)
        self._register = client.register_script(_REGISTER)
        await self._read_policy(client)

    async def close(self) -> None:
        self._closed = True
        for task in (self._probe, self._watch):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for client in (*self._stale, self._client):
            if client is not None:
                with contextlib.suppress(RedisError, OSError):
                    await client.aclose()

    # ── the interface ───────────────────────────────────────────────────────

    async def compare(
        self,
        namespace: str,
        vectors: Sequence[Vector],
        trace_ids: Sequence[str],
        *,
        add: bool,
        receipt: str | None = None,
    ) -> list[Comparison]:
        if not vectors:
            return []
        if not self._available:
            self._unmeasured_in_outage += len(vectors)
            self._ensure_probe()
            raise MemoryUnavailableError(self._unavailable_detail())
        # While Redis may evict the memory's keys, nothing is claimed as stored: the traces
        # are compared (a dry run) and answered as not stored, with the reason.
        refused = self._eviction if add else None
        if refused is not None:
            add = False
            self._not_stored_total += len(vectors)
        queries = [np.asarray(v, dtype=WIRE) for v in vectors]
        kept_as = "" if receipt is None or not add else f"{self.prefix}{{{namespace}}}:r:{receipt}"
        args: list[bytes | str] = ["1" if add else "0", kept_as, str(RECEIPT_TTL_MS)]
        for trace_id, vector in zip(trace_ids, queries, strict=True):
            if vector.shape != (self.dimensions,):
                raise ValueError(f"a vector of {vector.shape}, not ({self.dimensions},)")
            args += [trace_id, vector.tobytes()]
        reply = await self._run(namespace, "step", args, create=add, bulk=False)
        if reply is None:  # a dry run against a namespace that holds nothing yet
            empty = [[0, b"exact", 0]] * len(queries)
            compared = rescored(queries, trace_ids, empty, 0.0, add, self.capacity)
        else:
            now, _, _, results, *_ = reply
            compared = rescored(queries, trace_ids, results, float(now), add, self.capacity)
        if refused is not None:
            return [replace(c, not_stored=refused) for c in compared]
        return compared

    async def namespaces(self) -> list[str]:
        client = await self._ready_client()
        try:
            async with asyncio.timeout(self._timeout_s):
                names = sorted(text(n) for n in await client.smembers(self._registry))
                sizes: list[list[Any]] = [
                    await client.hmget(self._meta(n), "first", "next") for n in names
                ]
        except (RedisError, OSError, TimeoutError) as exc:
            raise self._failed(exc) from None
        return [n for n, (a, b) in zip(names, sizes, strict=True) if a and int(b) > int(a)]

    async def stats(self, namespace: str) -> CacheStats:
        """The namespace's figures in Redis; while Redis cannot be reached, the last ones this
        replica saw (backend.available says so)."""
        try:
            reply = await self._run(namespace, "stats", [], create=False, bulk=False)
        except MemoryUnavailableError:
            size = self._sizes.get(namespace, 0)
            return self._last_stats.get(namespace) or self._no_stats(size)
        if reply is None:
            return self._no_stats(0)
        now, size, capacity, ttl, adds, evictions, oldest, newest, entry_bytes, index_mb = reply
        now, size = float(now), int(size)
        ttl_ms = float(ttl) or None
        stats = CacheStats(
            size=size,
            capacity=int(capacity),
            dimensions=self.dimensions,
            ttl_ms=ttl_ms,
            memory_bytes=size * int(entry_bytes or 0) + int(float(index_mb or 0) * 2**20),
            oldest_age_ms=None if oldest is None else max(0.0, now - float(oldest)),
            newest_age_ms=None if newest is None else max(0.0, now - float(newest)),
            adds_total=int(adds or 0),
            evictions_total=int(evictions or 0),
        )
        self._last_stats[namespace] = stats
        return stats

    def _no_stats(self, size: int) -> CacheStats:
        return CacheStats(size, self.capacity, self.dimensions, self.ttl_ms, 0, None, None, 0, 0)

    async def clear(self, namespace: str) -> int:
        # Tried even while unavailable: a clear is also how operators give a namespace new
        # settings when the replicas' KP_CACHE_* disagree with it.
        reply = await self._run(namespace, "clear", [], create=False, bulk=True)
        if reply is None:
            return 0
        self._sizes[namespace] = 0
        self._verified.discard(namespace)  # the next step checks the index made again
        self._notes.pop(namespace, None)
        left = int(reply[2])
        while left > 0:  # the cleared keys, a batch a run: other requests go on between
            swept = await self._run(namespace, "sweep", [], create=False, bulk=True)
            left = 0 if swept is None else int(swept[1])
        client = await self._ready_client()
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(self._timeout_s):
                await client.srem(self._registry, namespace)
        self._known.discard(namespace)
        return int(reply[1])

    async def export_chunks(self, namespace: str) -> AsyncIterator[CacheEntries]:
        """The namespace's entries oldest first, BATCH a run; entries evicted meanwhile are
        left out, entries added meanwhile are not included."""
        start, stop = 0, None
        while stop is None or start < stop:
            reply = await self._run(namespace, "read", [str(start), str(BATCH)], bulk=True)
            if reply is None:
                return
            _, start, next_seq, *fields = reply
            start = int(start)
            stop = int(next_seq) if stop is None else stop
            if fields:
                yield CacheEntries(
                    np.stack([np.frombuffer(v, dtype=WIRE) for v in fields[2::3]]).astype(
                        np.float32
                    ),
                    np.array([float(t) for t in fields[1::3]], dtype=np.float64),
                    [text(t) for t in fields[0::3]],
                )
            if not fields and start >= int(next_seq):
                return

    async def import_entries(self, namespace: str, entries: CacheEntries) -> tuple[int, int]:
        """Appended BATCH entries a run (Redis serves other requests between runs)."""
        if not self._available:
            raise MemoryUnavailableError(self._unavailable_detail())
        if self._eviction is not None:
            raise MemoryUnavailableError(f"nothing was imported: {self._eviction}")
        added = skipped = 0
        ids = entries.ids()
        for begin in range(0, len(entries.vectors), BATCH):
            args: list[bytes | str] = []
            for i in range(begin, min(begin + BATCH, len(entries.vectors))):
                args += [
                    ids[i],
                    repr(float(entries.added_at_ms[i])),
                    np.asarray(entries.vectors[i], dtype=WIRE).tobytes(),
                ]
            try:
                reply = await self._run(namespace, "import", args, create=True, bulk=True)
            except MemoryUnavailableError as exc:
                raise MemoryUnavailableError(
                    f"{exc} ({added} entries of this import were added before it failed)"
                ) from None
            assert reply is not None  # create=True
            added, skipped = added + int(reply[3]), skipped + int(reply[4])
        return added, skipped

    # ── one script run ──────────────────────────────────────────────────────

    def _meta(self, namespace: str) -> str:
        return f"{self.prefix}{{{namespace}}}:meta"

    async def _ready_client(self) -> Redis | RedisCluster:
        async with self._connecting:  # one connect at a time: no client made twice
            if self._client is None:
                try:
                    await self._connect()
                except (QueryEngineMissingError, RedisError, OSError, TimeoutError) as exc:
                    raise self._failed(exc) from None
        assert self._client is not None
        return self._client

    async def _run(
        self,
        namespace: str,
        op: str,
        args: list[bytes | str],
        *,
        create: bool = False,
        bulk: bool = True,
    ) -> list[Any] | None:
        """memory.lua's `op` on the namespace's node: its reply after 'ok', or None when the
        namespace does not exist (and `create` is False). NamespaceUnavailableError when the
        namespace's index refuses it (the replica stays available for the others)."""
        if "{" in namespace or "}" in namespace:
            raise ValueError("a namespace may not hold braces")
        await self._ready_client()
        if create and namespace not in self._known:
            await self._register_namespace(namespace)
        keys = [self._meta(namespace)]
        # A step checks the namespace's index the first time this process meets it, and
        # while it is refused (a few FT.INFO, once).
        check = op == "step" and (namespace not in self._verified or namespace in self._faults)
        head = [
            op,
            f"{self.prefix}{{{namespace}}}:e:",
            f"{self.prefix}idx:{{{namespace}}}",
            f"{self.prefix}idx:{{{namespace}}}:hnsw",
            *self._settings,
            "1" if create else "0",
            "1" if check else "0",
        ]
        timeout_s = max(self._timeout_s, BULK_TIMEOUT_S) if bulk else self._timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                status, *body = await self._script(keys=keys, args=head + args)
            if status == b"settings_mismatch":
                self._mismatched = namespace
                raise SettingsMismatchError(text(body[0]))
        except (RedisError, OSError, TimeoutError, SettingsMismatchError) as exc:
            raise self._failed(exc) from None
        if namespace == self._mismatched:
            self._mismatched = None
        self._went_up()
        if status in (b"foreign_index", b"index_rebuilding"):
            raise self._namespace_refused(namespace, status, body)
        # Only a step checks the index: only a step's answer ends a refusal.
        if op == "step" and self._faults.pop(namespace, None) is not None:
            log.warning("namespace answers again", extra={"namespace": namespace})
        if status == b"absent":
            self._sizes.pop(namespace, None)
            return None
        if op == "step":
            self._verified.add(namespace)
            if body[5]:
                self._notes[namespace] = (
                    f"its HNSW index {text(body[5])}: it is not this service's, so FLAT "
                    "answers (exactly, but slower); drop it and DELETE /cache the namespace"
                )
            else:
                self._notes.pop(namespace, None)
        if op in ("step", "import"):
            created, size = int(body[1]), int(body[2])
            if created:  # made again after another replica cleared it: registered again
                self._known.discard(namespace)
                await self._register_namespace(namespace, limit=False)
            self._sizes[namespace] = size
            self._evictions[namespace] = int(body[4 if op == "step" else 5] or 0)
        return list(body)

    def _namespace_refused(
        self, namespace: str, status: bytes, body: list[Any]
    ) -> NamespaceUnavailableError:
        index = text(body[0])
        if status == b"foreign_index":
            why = (
                f"its index {index} is not this service's ({text(body[1])}), so it is never "
                f"searched: drop it (FT.DROPINDEX {index}) or give the service another "
                "KP_REDIS_PREFIX; nothing is added meanwhile"
            )
        else:
            if int(body[1]):
                self._index_rebuilds_total += 1
            why = (
                f"its index {index} went missing and was made again; Redis is indexing the "
                "namespace's entries into it, and it answers once that is done (nothing is "
                "added meanwhile)"
            )
        if self._faults.get(namespace) != why:
            log.error("namespace refused: its index", extra={"namespace": namespace, "reason": why})
        self._faults[namespace] = why
        self._verified.discard(namespace)
        self._no_expiry_before = 0.0  # registered, perhaps never made: the next sweep looks
        return NamespaceUnavailableError(f"the shared cache's namespace {namespace!r}: {why}")

    async def _register_namespace(self, namespace: str, *, limit: bool = True) -> None:
        admitted = await self._admitted(namespace, limit)
        if not admitted and time.monotonic() >= self._no_expiry_before:
            # Namespaces whose every entry expired no longer count: let go of them, then ask
            # again. Only once one may have expired since the last sweep (a new namespace
            # past the limit costs a sweep no more often than namespaces expire).
            async with self._sweeping:
                if time.monotonic() >= self._no_expiry_before:
                    await self._sweep_registry()
            admitted = await self._admitted(namespace, limit)
        if not admitted:
            raise NamespaceLimitError(
                f"namespace {namespace!r} would be one more than KP_MAX_NAMESPACES="
                f"{self.max_namespaces} namespaces holding entries"
            )
        self._known.add(namespace)

    async def _admitted(self, namespace: str, limit: bool) -> bool:
        try:
            async with asyncio.timeout(self._timeout_s):
                admitted = await self._register(
                    keys=[self._registry],
                    args=[namespace, str(self.max_namespaces if limit else 2**62)],
                )
        except (RedisError, OSError, TimeoutError) as exc:
            raise self._failed(exc) from None
        return bool(admitted)

    # ── while serving ───────────────────────────────────────────────────────

    async def _watch_while_serving(self) -> None:
        """Every WATCH_INTERVAL_S while Redis answers: its maxmemory-policy, the namespaces
        refused tried again, and (one replica at a time) expired namespaces let go."""
        while not self._closed:
            await asyncio.sleep(WATCH_INTERVAL_S)
            client = self._client
            if not self._available or client is None:
                continue  # the probe reconnects (and reads the policy then)
            try:
                await self._read_policy(client)
                for namespace in list(self._faults):
                    with contextlib.suppress(MemoryUnavailableError, NamespaceLimitError):
                        await self._run(namespace, "step", ["0", "", "0"], bulk=False)
                if self.ttl_ms is None:
                    continue
                async with asyncio.timeout(self._timeout_s):  # one replica a round sweeps
                    turn = await client.set(
                        f"{self.prefix}sweeping", "1", nx=True, px=int(WATCH_INTERVAL_S * 1000)
                    )
                if turn:
                    await self._sweep_registry()
            except (MemoryUnavailableError, RedisError, OSError, TimeoutError):
                continue
            except Exception:
                log.exception("shared cache watch failed; going on")

    async def _read_policy(self, client: Redis | RedisCluster) -> None:
        """Redis's maxmemory-policy, on every node (INFO: also where CONFIG is renamed): under
        one that may evict the memory's keys, nothing is stored until it changes."""
        try:
            async with asyncio.timeout(max(self._timeout_s, 1.0)):
                if isinstance(client, RedisCluster):
                    replies = await client.info("memory", target_nodes=RedisCluster.ALL_NODES)
                else:
                    replies = await client.info("memory")
        except ResponseError as exc:
            unread = (
                f"the shared cache's Redis does not say its maxmemory-policy ({exc}): it must "
                "be noeviction, or entries answered as stored may be evicted"
            )
            if self._policy_unread != unread:
                log.warning(unread)
            self._policy_unread = unread
            return
        self._policy_unread = None
        nodes = {"": replies} if "maxmemory_policy" in replies else replies
        unsafe = sorted(
            (name, str(info.get("maxmemory_policy")))
            for name, info in nodes.items()
            # allkeys-* may evict the memory's keys; volatile-* only keys with a TTL (none here)
            if isinstance(info, dict) and str(info.get("maxmemory_policy")).startswith("allkeys-")
        )
        eviction = None
        if unsafe:
            where = "".join(f" on {name}" for name, _ in unsafe[:1] if name)
            eviction = (
                f"the shared cache's Redis{where} runs maxmemory-policy {unsafe[0][1]}, which may "
                "evict the memory's entries: set it to noeviction (CONFIG SET "
                "maxmemory-policy noeviction)"
            )
        if eviction != self._eviction:
            if eviction is not None:
                log.error("shared cache: traces are not stored", extra={"reason": eviction})
            else:
                log.warning("shared cache: traces are stored again (maxmemory-policy)")
        self._eviction = eviction

    async def _sweep_registry(self) -> None:
        """Lets go of the registered namespaces whose every entry expired (or that hold
        nothing: a foreign index refused them before they were made): their keys, indexes
        and hash deleted, and their place among KP_MAX_NAMESPACES given back."""
        client = await self._ready_client()
        try:
            async with asyncio.timeout(max(self._timeout_s, 1.0)):
                names = sorted(text(n) for n in await client.smembers(self._registry))
        except (RedisError, OSError, TimeoutError) as exc:
            raise self._failed(exc) from None
        gone: list[str] = []
        # In seconds from now: when the first of the live namespaces can expire.
        expiries: list[float] = [math.inf]
        started = time.monotonic()

        async def retire(namespace: str) -> None:
            while True:
                reply = await self._run(namespace, "retire", [], bulk=True)
                if reply is None or reply[1] == b"gone":
                    gone.append(namespace)
                    return
                if reply[1] == b"live":
                    if self.ttl_ms is not None:
                        now, newest = float(reply[0]), float(reply[3])
                        expiries.append((newest + self.ttl_ms - now) / 1000.0)
                    return
                if reply[1] != b"sweeping":
                    return

        for start in range(0, len(names), SWEEP_CONCURRENCY):
            batch = names[start : start + SWEEP_CONCURRENCY]
            done = await asyncio.gather(*(retire(n) for n in batch), return_exceptions=True)
            if any(isinstance(d, Exception) for d in done):
                expiries.append(0.0)  # not all were looked at: the next one sweeps again
        # A namespace registered after the sweep began expires a TTL after it at the
        # earliest; and at least once a minute besides: a namespace registered but never made
        # (its step failed) holds a place until a sweep finds it absent.
        ttl_s = math.inf if self.ttl_ms is None else self.ttl_ms / 1000.0
        self._no_expiry_before = started + max(0.0, min(60.0, ttl_s, *expiries))
        if not gone:
            return
        try:
            async with asyncio.timeout(max(self._timeout_s, 1.0)):
                await client.srem(self._registry, *gone)
        except (RedisError, OSError, TimeoutError) as exc:
            raise self._failed(exc) from None
        for namespace in gone:  # what this replica kept of it
            self._retired_evictions += self._evictions.pop(namespace, 0)
            for kept in (self._sizes, self._last_stats, self._notes):
                kept.pop(namespace, None)
            self._known.discard(namespace)
            self._verified.discard(namespace)
        log.info("expired namespaces let go", extra={"namespaces": len(gone)})

    # ── outages ─────────────────────────────────────────────────────────────

    def _failed(self, exc: BaseException) -> MemoryUnavailableError:
        self._went_down(exc)
        return MemoryUnavailableError(self._unavailable_detail())

    def _unavailable_detail(self) -> str:
        return f"the shared cache at {self.location} is unavailable: {self._reason}"

    def _went_down(self, exc: BaseException) -> None:
        self._reason = describe(exc)
        if not self._available:
            return
        self._available = False
        if self._client is not None:
            self._stale.append(self._client)
            self._client = None
        self._outages_total += 1
        self._outage_started = time.monotonic()
        self._unmeasured_in_outage = 0
        log.error(
            "shared cache unavailable: novelty is not measured (0.5, cache_unavailable) "
            "until Redis answers again",
            extra={"redis": self.location, "prefix": self.prefix, "reason": self._reason},
        )
        self._ensure_probe()

    def _went_up(self) -> None:
        if self._available:
            return
        self._available = True
        log.warning(
            "shared cache available again",
            extra={
                "redis": self.location,
                "outage_s": round(time.monotonic() - self._outage_started, 3),
                "traces_unmeasured": self._unmeasured_in_outage,
            },
        )

    def _ensure_probe(self) -> None:
        if self._closed or (self._probe is not None and not self._probe.done()):
            return
        with contextlib.suppress(RuntimeError):  # no running loop: the next request starts it
            self._probe = asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        """While unavailable: what notices that Redis is back, or that a clear elsewhere gave
        the namespace whose settings differed this replica's."""
        while not self._available and not self._closed:
            await asyncio.sleep(RETRY_INTERVAL_S)
            while self._stale:
                with contextlib.suppress(RedisError, OSError):
                    await self._stale.pop().aclose()
            try:
                client = await self._ready_client()
                mismatched = self._mismatched
                if mismatched is None:
                    async with asyncio.timeout(self._timeout_s):
                        await client.ping()
                    self._went_up()
                else:
                    await self._run(mismatched, "step", ["0", "", "0"], bulk=False)
            except MemoryUnavailableError:
                continue
            except (RedisError, OSError, TimeoutError) as exc:
                self._reason = describe(exc)
                continue
            except Exception:
                # The probe must outlive any surprise, or the replica stays refused for good.
                log.exception("shared cache probe failed; retrying")
