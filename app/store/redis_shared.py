"""The shared novelty memory (KP_REDIS_URL): every replica on one Redis sees one cache.

Why the answers of all replicas equal one-at-a-time scoring in one order
(docs/operating/scaling.md):

- The order is a Redis stream, `<prefix>novelty:log`. Every change is one run of a Lua script
  (exchange.lua), and Redis runs scripts one at a time. A run appends this replica's vectors
  (XADD: the entry's id is its place in the order and Redis's clock in ms) and returns, in the
  same round trip, every entry added since this replica last looked: all of them come before
  its own.
- Each replica keeps a mirror of the log: an IndexedCache with the same capacity and TTL, so the
  exact maximum-cosine code is the in-process one. It applies the returned entries in log
  order; each of its own traces is compared with the mirror as it stands just before that
  trace's entry (at that entry's time, for the TTL), then added. That is the answer
  one-at-a-time scoring in log order gives. A batch's entries are consecutive (one script run
  appends them); a dry run appends nothing and reads the mirror brought up to date.
- A replica has one exchange in flight at a time; requests that arrive meanwhile go together
  in the next one. So its mirror follows the log without a gap or a reordering.
- Capacity: XADD MAXLEN keeps the newest `capacity` entries; TTL: XTRIM MINID at Redis's TIME.
  The mirror evicts and expires the same entries by the same rules on the same times.
- DELETE /cache: reset.lua writes a new epoch and empties the log. A replica that meets an
  epoch it does not know rebuilds its mirror from the log, as after FLUSHALL or a Redis that
  lost its data (the epoch is gone with it).
- A large memory's graph: a replica that built one publishes it, one that starts adopts it
  instead of building (app/store/redis_graph.py; KP_CACHE_INDEX_SHARE).

Only vectors (float32 bytes), their trace ids and Redis's ids travel; each replica embeds.

Redis down: requests get MemoryUnavailableError at once (nothing added), one log line marks
the outage and one its end, and a probe retries every RETRY_INTERVAL_S. No request waits for
Redis longer than the timeout. A request whose exchange timed out after Redis ran it has its
entries in the log although its answer said cache_unavailable; the replicas see them on their
next exchange, as part of the order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from importlib import resources
from typing import Any, TypeVar

import numpy as np
from redis.asyncio import Redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from app.core.health import UNMEASURED, Health
from app.domain.vector_cache import CacheEntries, CacheStats
from app.store.ann_index import DEFAULT_PARAMS, AnnIndex
from app.store.base import (
    DEFAULT_NAMESPACE,
    BackendInfo,
    Comparison,
    MemoryUnavailableError,
    Vector,
)
from app.store.in_process import compare_in_order
from app.store.indexed_memory import (
    DEFAULT_INDEX_THRESHOLD,
    BuiltGraph,
    IndexedCache,
    IndexStatus,
    SearchMode,
)
from app.store.redis_graph import GraphCover, GraphDescription, SharedGraph

log = logging.getLogger(__name__)

RETRY_INTERVAL_S = 0.5
#: Vectors one exchange appends at most when it carries several requests (a larger batch
#: still goes whole, alone).
GROUP_VECTORS = 256
#: Entries one run of import.lua appends (about 1.5 MB of vectors).
IMPORT_BATCH = 1000
#: Log entries one exchange returns at most: a replica far behind (a start against a large
#: memory, a long outage) catches up a page at a time, each well within KP_REDIS_TIMEOUT_MS,
#: and Redis serves the other replicas between pages.
PAGE = 2000
#: How long one bulk exchange may take: a page of the log during the first catch-up, after
#: this replica's import or after a page that said more follow (about 3.6 MB), or a batch of
#: an import (about 1.5 MB), on a CPU that may be slow and busy building the index. No
#: request needs them done (a request waits under its own budget; an import is an
#: operator's), so KP_REDIS_TIMEOUT_MS, a request's budget, is not their bound; this one
#: catches a Redis that stopped answering. It is also the socket's read timeout, a
#: backstop under every exchange's own bound.
BULK_TIMEOUT_S = 30.0
#: How long the feeder waits for Redis to say whether its grown graph would be published
#: (the answer spares every other replica serializing it); past it, the graph is serialized
#: and the publish decides, as without the question.
GRAPH_QUESTION_TIMEOUT_S = 2.0
_WIRE = np.dtype("<f4")
_T = TypeVar("_T")
#: exchange.lua's first reply element: its run went through, or this replica's settings
#: differ from the memory's (the second element says how).
EXCHANGED = b"ok"
SETTINGS_MISMATCH = b"settings_mismatch"


class SettingsMismatchError(Exception):
    """This replica's KP_CACHE_* or model differ from the shared memory's."""


def script_text(name: str) -> str:
    """One of the package's Lua scripts (exchange.lua, reset.lua)."""
    return (resources.files("app.store") / name).read_text(encoding="utf-8")


def _ms_of(entry_id: bytes) -> float:
    return float(entry_id.split(b"-", 1)[0])


def _number(value: float | None) -> str:
    if value is None:
        return "0"
    return str(int(value)) if float(value).is_integer() else repr(float(value))


@dataclass(slots=True)
class _Exchange:
    """A request's turn: its vectors to compare (and append, with `add`)."""

    vectors: Sequence[Vector]
    trace_ids: Sequence[str]
    add: bool
    future: asyncio.Future[list[Comparison]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    budget: asyncio.Timeout | None = None  # the request's wait for Redis (None: no timeout)

    def lift_budget(self) -> None:
        """Redis has answered: what is left is the mirror's comparison, milliseconds at a large
        memory, which is not Redis's time (a budget that has run out stays run out)."""
        budget = self.budget
        if budget is not None and not budget.expired() and not self.future.done():
            budget.reschedule(None)


@dataclass(slots=True)
class _Reset:
    future: asyncio.Future[int] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    budget: asyncio.Timeout | None = None  # never lifted: its work ends with Redis's answer


class RedisSharedMemory:
    """The novelty memory of every replica on one Redis and prefix (the module's docstring
    says how it keeps one order). `mirror` is this replica's copy of the shared entries."""

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
        search: SearchMode = "auto",
        index_threshold: int = DEFAULT_INDEX_THRESHOLD,
        index_ef_search: int = DEFAULT_PARAMS.ef_search,
        index_ef_search_far: int = DEFAULT_PARAMS.ef_search_far,
        index_share: bool = True,
    ) -> None:
        self.location = location
        self.prefix = prefix
        self.capacity = capacity
        self.ttl_ms = ttl_ms
        self.model = model or ""
        self._timeout_s = timeout_ms / 1000.0
        # No retries inside redis-py: a failed exchange is reported at once and the probe
        # reconnects, so that no request waits longer than the timeout (each exchange's own
        # bound; the socket's is the backstop).
        self._client = Redis.from_url(
            url,
            socket_timeout=max(self._timeout_s, BULK_TIMEOUT_S),
            socket_connect_timeout=self._timeout_s,
            retry=Retry(NoBackoff(), 0),
            client_name="kp-scoring",
        )
        self._exchange_script = self._client.register_script(script_text("exchange.lua"))
        self._reset_script = self._client.register_script(script_text("reset.lua"))
        self._import_script = self._client.register_script(script_text("import.lua"))
        self._keys = [f"{prefix}novelty:log", f"{prefix}novelty:meta"]
        self._now_ms = 0.0  # Redis's clock as of the step being applied
        self.mirror = IndexedCache(
            capacity,
            dimensions,
            ttl_ms,
            clock_ms=lambda: self._now_ms,
            search=search,
            index_threshold=index_threshold,
            index_ef_search=index_ef_search,
            index_ef_search_far=index_ef_search_far,
        )
        self._epoch = b""
        self._last_id = b"0-0"
        self._graph = SharedGraph(
            self._client,
            prefix,
            max(self._timeout_s, BULK_TIMEOUT_S),
            script_text("graph_publish.lua"),
        )
        self._share = index_share and search == "auto"
        if self._share:
            self.mirror.on_graph_built = self._graph_built
            self.mirror.graph_wanted = self._graph_wanted
        self._loop: asyncio.AbstractEventLoop | None = None
        # (the mirror's lineage, log ordinal - sequence number) as of the last exchange
        # that brought the mirror to the log's end (redis_graph's docstring).
        self._ordinal: tuple[str, int] | None = None
        self._unusable_graph: str | None = None  # the token of a published graph found damaged
        # A graph built before the mirror reached the log's end (its ordinals unknown yet).
        self._unpublished: BuiltGraph | None = None
        self._adds_total = 0
        self._evictions_total = 0
        self._queue: deque[_Exchange | _Reset] = deque()
        self._flusher: asyncio.Task[None] | None = None
        self._probe: asyncio.Task[None] | None = None
        self._warmer: asyncio.Task[None] | None = None
        self._followers: set[asyncio.Task[None]] = set()
        self._caught_up = False
        # The next exchange brings a page of the log that is known to be there (this
        # replica's own import, or the rest of a log an exchange said was longer): bulk work,
        # under BULK_TIMEOUT_S, not a request's KP_REDIS_TIMEOUT_MS.
        self._pages_due = False
        self._first_answer = asyncio.Event()
        self._log_length = 0
        self._closed = False
        self._available = True  # until an exchange says otherwise
        self._reason: str | None = None
        self._outages_total = 0
        self._outage_started = 0.0
        self._unmeasured_in_outage = 0

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
        return self.mirror.size

    def index_status(self) -> IndexStatus:
        """The mirror's index; while the first catch-up runs, warming with its progress."""
        status = self.mirror.index_status()
        loading = self.warming
        if loading is None:
            return status
        loaded, total = loading
        return dataclasses.replace(status, warming=True, progress=loaded / total if total else 0.0)

    def run_audit(self, limit: int) -> int:
        return self.mirror.run_audit(limit)

    @property
    def dimensions(self) -> int:
        return self.mirror.dimensions

    @property
    def evictions_total(self) -> int:
        return self._evictions_total

    @property
    def local_cache(self) -> IndexedCache:
        return self.mirror

    def health(self) -> Health:
        if self._available:
            return Health()
        return Health(
            degraded=True,
            warnings=(UNMEASURED + self._unavailable_detail(),),
        )

    # ── lifecycle ───────────────────────────────────────────────────────────

    async def start(self) -> None:
        """Loads the mirror: the first page now (a new memory takes this replica's
        settings), the rest in the background (the service answers /healthz meanwhile, and
        /readyz says warming). Redis down or other settings are reported, not fatal: the
        start goes on as soon as the first exchange has failed, without waiting the timeout."""
        self._loop = asyncio.get_running_loop()
        self._warmer = asyncio.create_task(self._warm())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._first_answer.wait()), self._timeout_s)

    async def _warm(self) -> None:
        """The first catch-up, to the log's end: a failed page (Redis gone meanwhile) is
        retried, and the replica stays warming (not ready) until it has every entry. With a
        published graph, the mirror builds none meanwhile: it adopts that one if it fits."""
        lookup: asyncio.Task[GraphDescription | None] | None = None
        if self._share:
            # Looked up beside the first pages (not before them: a Redis that does not
            # answer must not delay the start); the hold ends as soon as none is found.
            self.mirror.hold_index(True)
            lookup = asyncio.create_task(self._graph.described())
            lookup.add_done_callback(self._hold_while_published)
        try:
            while not self._closed:
                await self._follow()
                if self._caught_up:
                    break
                await asyncio.sleep(RETRY_INTERVAL_S)
            self._first_answer.set()
            if lookup is not None and not self._closed:
                with contextlib.suppress(RedisError, OSError, TimeoutError):
                    if await lookup is not None:
                        await self._adopt_published()
        finally:
            if lookup is not None:
                lookup.cancel()
            self.mirror.hold_index(False)

    def _hold_while_published(self, lookup: asyncio.Task[GraphDescription | None]) -> None:
        if lookup.cancelled() or lookup.exception() is not None or lookup.result() is None:
            self.mirror.hold_index(False)

    async def _adopt_published(self) -> None:
        """Adopts the published graph when it was built in this epoch, with these settings,
        and covers the mirror's oldest entries (the mirror checks its codes too); anything
        else is logged and the mirror builds its own."""
        started = time.monotonic()
        why: str | None = None
        try:
            about = await self._graph.described()
            ordinal = self._ordinal
            if about is None:
                why = "it is gone (replaced or reset)"
            elif ordinal is None or ordinal[0] != self.mirror.lineage:
                why = "the mirror is not caught up with the log"
            else:
                why = about.differs_from(self._epoch, self.mirror.dimensions, self.model)
            if why is None and about is not None and ordinal is not None:
                first_id = about.first_ordinal - ordinal[1]
                first, next_seq = self.mirror.sequence_range
                if not first_id <= first < first_id + about.count <= next_seq:
                    why = (
                        f"it covers log entries {about.first_ordinal}.."
                        f"{about.first_ordinal + about.count - 1}, the mirror holds "
                        f"{first + ordinal[1]}..{next_seq - 1 + ordinal[1]}"
                    )
                else:
                    try:
                        data = await self._graph.download(about)
                        index = await asyncio.to_thread(
                            AnnIndex.from_bytes, data, self.mirror.dimensions, 0
                        )
                    except ValueError:
                        self._unusable_graph = about.token  # this replica's graph replaces it
                        raise
                    del data
                    if self._ordinal != ordinal:  # a reset or new epoch meanwhile
                        why = "the memory changed while it was downloaded"
                    else:
                        why = self.mirror.adopt_index(index, first_id)
        except (RedisError, OSError, TimeoutError, ValueError) as exc:
            why = _describe(exc)
        if why is not None:
            log.warning(
                "published graph not adopted; this replica builds its own",
                extra={"prefix": self.prefix, "reason": why},
            )
            return
        log.info(
            "published graph adopted",
            extra={
                "prefix": self.prefix,
                "entries": self.mirror.index_status().indexed,
                "seconds": round(time.monotonic() - started, 2),
            },
        )

    def _graph_built(self, built: BuiltGraph) -> None:
        """The mirror's on_graph_built (its build or feeder thread): the loop publishes it."""
        loop = self._loop
        if loop is None or self._closed:
            return
        with contextlib.suppress(RuntimeError):  # the loop has closed
            loop.call_soon_threadsafe(self._publish_soon, built)

    def _graph_wanted(self, first_seq: int, count: int, lineage: str) -> bool:
        """The mirror's graph_wanted (its feeder thread, which may wait): whether a graph of
        these entries would be published now. When Redis cannot tell, it is serialized and
        publish decides, as without the question."""
        loop, ordinal = self._loop, self._ordinal
        if self._closed or lineage != self.mirror.lineage:
            return False
        if loop is None or ordinal is None or ordinal[0] != lineage:
            return True
        with contextlib.suppress(RuntimeError):  # the loop has closed: nothing to publish
            return self._ask_loop(loop, first_seq + ordinal[1], count)
        return False

    def _ask_loop(self, loop: asyncio.AbstractEventLoop, first_ordinal: int, count: int) -> bool:
        asked = asyncio.run_coroutine_threadsafe(
            self._graph.would_publish(
                self._cover(self._epoch, first_ordinal, count), self._unusable_graph
            ),
            loop,
        )
        try:
            return asked.result(timeout=GRAPH_QUESTION_TIMEOUT_S)
        except (RedisError, OSError, TimeoutError, concurrent.futures.CancelledError):
            asked.cancel()
            return True

    def _cover(self, epoch: bytes, first_ordinal: int, count: int) -> GraphCover:
        return GraphCover(epoch, first_ordinal, count, self.mirror.dimensions, self.model)

    def _publish_soon(self, built: BuiltGraph) -> None:
        ordinal = self._ordinal
        if self._closed or built.lineage != self.mirror.lineage:
            return  # built on entries the mirror no longer holds (a reset, a new epoch)
        if ordinal is None or ordinal[0] != built.lineage:
            self._unpublished = built  # published once the mirror reaches the log's end
            return
        self._unpublished = None
        task = asyncio.create_task(self._publish(built, self._epoch, built.first_seq + ordinal[1]))
        self._followers.add(task)
        task.add_done_callback(self._followers.discard)

    async def _publish(self, built: BuiltGraph, epoch: bytes, first_ordinal: int) -> None:
        started = time.monotonic()
        try:
            outcome = await self._graph.publish(
                built.data, self._cover(epoch, first_ordinal, built.count), self._unusable_graph
            )
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning(
                "graph not published; replicas that start build their own",
                extra={"prefix": self.prefix, "reason": _describe(exc)},
            )
            return
        log.info(
            "graph for the replicas: " + outcome,
            extra={
                "prefix": self.prefix,
                "entries": built.count,
                "bytes": len(built.data),
                "seconds": round(time.monotonic() - started, 2),
            },
        )

    async def _follow(self) -> None:
        """Reads the log up to its end, without a timeout: as many pages as it holds."""
        request = _Exchange([], [], add=False)
        self._queue.append(request)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        with contextlib.suppress(MemoryUnavailableError):
            await request.future

    @property
    def warming(self) -> tuple[int, int] | None:
        """(entries loaded, entries in the log) while the first catch-up runs, else None."""
        if self._caught_up:
            return None
        return self.mirror.size, max(self._log_length, self.mirror.size)

    async def close(self) -> None:
        self._closed = True
        for task in (self._probe, self._flusher, self._warmer, *self._followers):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._fail_queued(MemoryUnavailableError("the service is stopping"))
        await self._client.aclose()

    # ── the interface ───────────────────────────────────────────────────────

    def _only_default(self, namespace: str) -> None:
        if namespace != DEFAULT_NAMESPACE:
            raise MemoryUnavailableError(
                f"this shared memory keeps only the namespace {DEFAULT_NAMESPACE!r}"
            )

    async def namespaces(self) -> list[str]:
        return [DEFAULT_NAMESPACE] if self.mirror.size else []

    async def compare(
        self, namespace: str, vectors: Sequence[Vector], trace_ids: Sequence[str], *, add: bool
    ) -> list[Comparison]:
        self._only_default(namespace)
        if not self._available:
            self._unmeasured_in_outage += len(vectors)
            self._ensure_probe()
            raise MemoryUnavailableError(self._unavailable_detail())
        loading = self.warming
        if loading is not None and loading[1] > PAGE:
            # A large log is still being loaded: an answer now would wait for all of it.
            raise MemoryUnavailableError(
                f"the shared cache at {self.location} is loading (cache_warming): "
                f"{loading[0]} of {loading[1]} entries"
            )
        request = _Exchange(vectors, trace_ids, add)
        return await self._submit(request, request.future)

    async def stats(self, namespace: str) -> CacheStats:
        """The shared memory's figures after catching up with the log; the mirror's last
        view when Redis cannot be reached (backend.available says so)."""
        self._only_default(namespace)
        if self._available:
            with contextlib.suppress(MemoryUnavailableError):
                await self._sync()
        return dataclasses.replace(
            self.mirror.stats(),
            adds_total=self._adds_total,
            evictions_total=self._evictions_total,
        )

    async def clear(self, namespace: str) -> int:
        self._only_default(namespace)
        # Tried even while unavailable: a reset is also how operators give the memory new
        # settings when the replicas' KP_CACHE_* disagree with it.
        reset = _Reset()
        return await self._submit(reset, reset.future)

    async def export_chunks(self, namespace: str) -> AsyncIterator[CacheEntries]:
        """The shared memory, brought up to date, from this replica's mirror of it."""
        self._only_default(namespace)
        await self._sync()
        for chunk in self.mirror.chunks():
            yield chunk
            await asyncio.sleep(0)

    async def import_entries(self, namespace: str, entries: CacheEntries) -> tuple[int, int]:
        """Appended by import.lua, IMPORT_BATCH entries a run (Redis serves others between
        runs); the replicas' mirrors, this one's too, read them from the log as usual."""
        self._only_default(namespace)
        if not self._available:
            raise MemoryUnavailableError(self._unavailable_detail())
        added = skipped = 0
        settings = [str(self.capacity), _number(self.ttl_ms), self.model]
        ids = entries.ids()
        for start in range(0, len(entries.vectors), IMPORT_BATCH):
            args: list[bytes | str] = list(settings)
            for i in range(start, min(start + IMPORT_BATCH, len(entries.vectors))):
                args += [
                    ids[i],
                    repr(float(entries.added_at_ms[i])),
                    np.asarray(entries.vectors[i], dtype=_WIRE).tobytes(),
                ]
            try:
                async with asyncio.timeout(max(self._timeout_s, BULK_TIMEOUT_S)):
                    status, *body = await self._import_script(keys=self._keys, args=args)
                if status == SETTINGS_MISMATCH:
                    raise SettingsMismatchError(body[0].decode())
                appended, expired = body
            except (RedisError, OSError, TimeoutError, SettingsMismatchError) as exc:
                self._went_down(exc)
                raise MemoryUnavailableError(
                    f"{self._unavailable_detail()} ({added} entries of this import were "
                    "added before it failed)"
                ) from None
            added, skipped = added + int(appended), skipped + int(expired)
        # The mirror reads them in the background, a page at a time (a request meanwhile
        # waits behind those pages).
        self._pages_due = True
        self._followers.add(task := asyncio.create_task(self._follow()))
        task.add_done_callback(self._followers.discard)
        return added, skipped

    # ── one exchange at a time ──────────────────────────────────────────────

    async def _sync(self) -> None:
        """Bring the mirror up to date (an exchange that appends nothing)."""
        request = _Exchange([], [], add=False)
        await self._submit(request, request.future)

    async def _submit(self, item: _Exchange | _Reset, future: asyncio.Future[_T]) -> _T:
        self._queue.append(item)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        try:
            async with asyncio.timeout(self._timeout_s) as item.budget:
                return await future
        except TimeoutError:
            # The future is cancelled: if it was still queued, it is never sent.
            raise MemoryUnavailableError(
                f"no answer from Redis at {self.location} within "
                f"{self._timeout_s * 1000:g} ms (KP_REDIS_TIMEOUT_MS)"
            ) from None

    async def _flush(self) -> None:
        while self._queue:
            item = self._queue.popleft()
            if item.future.done():
                continue  # its request gave up
            if isinstance(item, _Reset):
                await self._run_reset(item)
                continue
            group = [item]
            appending = len(item.vectors) if item.add else 0
            while self._queue and isinstance(nxt := self._queue[0], _Exchange):
                more = len(nxt.vectors) if nxt.add else 0
                if appending + more > GROUP_VECTORS:
                    break
                self._queue.popleft()
                if not nxt.future.done():
                    group.append(nxt)
                    appending += more
            await self._run_exchange(group)

    async def _run_exchange(self, group: list[_Exchange]) -> None:
        args: list[bytes | str] = [
            self._epoch,
            self._last_id,
            str(self.capacity),
            _number(self.ttl_ms),
            self.model,
            str(PAGE),
        ]
        for request in group:
            if request.add:
                for trace_id, vector in zip(request.trace_ids, request.vectors, strict=True):
                    args += [trace_id, np.asarray(vector, dtype=_WIRE).tobytes()]
        bulk = not self._caught_up or self._pages_due
        timeout_s = max(self._timeout_s, BULK_TIMEOUT_S) if bulk else self._timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                reply = await self._exchange_script(keys=self._keys, args=args)
            compare_own = self._apply(reply, group)
            if compare_own is None:
                # Not caught up: the log's next page first, then these requests again.
                self._queue.extendleft(reversed(group))
                self._went_up()
                return
            # No other exchange runs meanwhile (this task runs them one at a time), so the
            # mirror meets the requests in the log's order on either thread.
            for request in group:
                request.lift_budget()
            if self.mirror.size >= self.mirror.index_threshold:
                results = await asyncio.to_thread(compare_own)
            else:
                results = compare_own()
        except (RedisError, OSError, TimeoutError, ValueError, SettingsMismatchError) as exc:
            self._went_down(exc)
            error = MemoryUnavailableError(self._unavailable_detail())
            for request in group:
                if not request.future.done():
                    request.future.set_exception(error)
            self._fail_queued(error)
            return
        self._went_up()
        for request, result in zip(group, results, strict=True):
            if not request.future.done():
                request.future.set_result(result)

    def _apply(
        self, reply: list[Any], group: list[_Exchange]
    ) -> Callable[[], list[list[Comparison]]] | None:
        """The log's new entries into the mirror (without awaiting: nothing else changes the
        mirror meanwhile); then what compares this replica's own requests with it in order,
        to be called next (None: a page of the log only, more waits)."""
        status, *body = reply
        if status == SETTINGS_MISMATCH:
            raise SettingsMismatchError(body[0].decode())
        if status != EXCHANGED:
            raise ValueError(f"exchange.lua answered {status!r}: not this service's script")
        epoch, now_ms, full, entries, own_ids, adds_total, evictions_total, more, length = body
        self._log_length = int(length)
        self._first_answer.set()
        if full:
            self.mirror.clear()
            self._epoch, self._last_id = epoch, b"0-0"
        if entries:
            read = [self._entry_of(fields) for _, fields in entries]
            times = np.array([_ms_of(entry_id) for entry_id, _ in entries], dtype=np.float64)
            self.mirror.extend(
                np.stack([vector for vector, _ in read]), times, [t for _, t in read]
            )
            self._now_ms = float(times[-1])
            self._last_id = entries[-1][0]
        self._adds_total, self._evictions_total = int(adds_total), int(evictions_total)
        self._pages_due = bool(more)
        if more:
            return None
        self._caught_up = True
        # The log's newest entry has ordinal adds_total - 1; the mirror's own entries of
        # this run are added below, as many as the log received.
        self._ordinal = (
            self.mirror.lineage,
            int(adds_total) - self.mirror.sequence_range[1] - len(own_ids),
        )
        if self._unpublished is not None:
            self._publish_soon(self._unpublished)
        return partial(self._compare_own, group, own_ids, float(now_ms))

    def _compare_own(
        self, group: list[_Exchange], own_ids: list[bytes], now_ms: float
    ) -> list[list[Comparison]]:
        """Each of this replica's requests against the mirror as it stood just before its
        entries (at their times, for the TTL), in the log's order."""
        own = iter(own_ids)
        results = []
        for request in group:
            if request.add:
                compared = []
                for vector, trace_id in zip(request.vectors, request.trace_ids, strict=True):
                    entry_id = next(own)
                    self._now_ms = _ms_of(entry_id)  # the mirror's clock: the entry's time
                    (comparison,) = compare_in_order(self.mirror, [vector], [trace_id], add=True)
                    self._last_id = entry_id
                    compared.append(comparison)
                results.append(compared)
            else:
                self._now_ms = max(self._now_ms, now_ms)
                results.append(
                    compare_in_order(self.mirror, request.vectors, request.trace_ids, add=False)
                )
        return results

    def _entry_of(self, fields: list[bytes]) -> tuple[Vector, str]:
        named = dict(zip(fields[::2], fields[1::2], strict=True))
        data = named.get(b"v", b"")
        if len(data) != self.mirror.dimensions * _WIRE.itemsize:
            raise ValueError(
                f"a log entry holds {len(data)} bytes, not a {self.mirror.dimensions}-float "
                "vector: another kind of service writes under this KP_REDIS_PREFIX"
            )
        trace_id = named.get(b"trace", b"").decode("utf-8", "replace")
        return np.frombuffer(data, dtype=_WIRE).astype(np.float32), trace_id

    async def _run_reset(self, item: _Reset) -> None:
        try:
            async with asyncio.timeout(self._timeout_s):
                epoch, now_ms, cleared = await self._reset_script(
                    keys=[*self._keys, self._graph.described_key],
                    args=[
                        str(self.capacity),
                        _number(self.ttl_ms),
                        self.model,
                        self._graph.chunk_prefix,
                    ],
                )
        except (RedisError, OSError, TimeoutError) as exc:
            self._went_down(exc)
            if not item.future.done():
                item.future.set_exception(MemoryUnavailableError(self._unavailable_detail()))
            return
        self.mirror.clear()
        self._epoch, self._last_id, self._now_ms = epoch, b"0-0", float(now_ms)
        self._went_up()
        if not item.future.done():
            item.future.set_result(int(cleared))

    def _fail_queued(self, error: MemoryUnavailableError) -> None:
        while self._queue:
            item = self._queue.popleft()
            if not item.future.done():
                item.future.set_exception(error)

    # ── outages ─────────────────────────────────────────────────────────────

    def _unavailable_detail(self) -> str:
        return f"the shared cache at {self.location} is unavailable: {self._reason}"

    def _went_down(self, exc: BaseException) -> None:
        self._reason = _describe(exc)
        self._first_answer.set()
        if not self._available:
            return
        self._available = False
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
        """A probe runs while the memory is unavailable: it is what notices that Redis is
        back, or that a reset elsewhere gave the shared memory this replica's settings."""
        if not self._closed and (self._probe is None or self._probe.done()):
            self._probe = asyncio.create_task(self._reconnect())

    async def _reconnect(self) -> None:
        while not self._available:
            await asyncio.sleep(RETRY_INTERVAL_S)
            try:
                await self._sync()
            except MemoryUnavailableError:
                pass
            except Exception:
                # The probe must outlive any surprise, or the replica stays refused for good.
                log.exception("shared cache probe failed; retrying")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "no answer within KP_REDIS_TIMEOUT_MS"
    text = str(exc)
    if isinstance(exc, SettingsMismatchError):
        return (
            f"{text}: give every replica the same settings, "
            "or DELETE /cache from one with the new ones"
        )
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
