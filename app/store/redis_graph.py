"""The graph of a shared memory, published in Redis for the replicas that start later.

A new replica against a large shared memory would otherwise build the whole graph itself
(minutes at a million entries). A replica that built one publishes it, and a replica that
starts adopts it when it covers the log entries it holds (docs/operating/large-memory.md).

Keys, beside the log (`<prefix>novelty:log`):

- `<prefix>novelty:graph`: a hash describing the published graph: the memory's epoch it was
  built in, the log ordinal of its first entry and its count, dimensions, m,
  efConstruction, model, size, SHA-256, and its chunks' token and number.
- `<prefix>novelty:graph:<token>:<i>`: the serialized graph (AnnIndex.to_bytes) in chunks of
  CHUNK bytes (a Redis string holds at most 512 MB).
- `<prefix>novelty:graph:lease`: one publisher at a time (SET NX PX).

Log ordinals: the memory's hash counts every entry ever appended (`adds`), in log order, so an
entry's ordinal (the count before its append) names it in every replica's mirror; within an
epoch, a mirror's sequence numbers are the ordinals minus one offset (RedisSharedMemory
computes it after each exchange). A reset (reset.lua) deletes the graph with the log.

When to publish: when no graph is published for this epoch and settings, or the new one has
at least REPUBLISH_SHARE of its entries past the published one's last (a replica adopting a
graph feeds the entries after it one by one: a stale graph makes that tail long), or the
published one could not be adopted for damage (a replica that found it so replaces it).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import uuid
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import RedisError

from app.store.ann_index import DEFAULT_PARAMS

#: Bytes a chunk of the graph holds (a million entries' graph, about 0.9 GB, is 110 of them).
CHUNK = 8 << 20
#: How long a publisher holds the lease (writing a million entries' graph takes seconds).
LEASE_MS = 300_000
#: A new graph replaces the published one when this share of its entries are newer.
REPUBLISH_SHARE = 0.1


@dataclass(frozen=True, slots=True)
class GraphDescription:
    token: str
    chunks: int
    epoch: bytes
    first_ordinal: int
    count: int
    dimensions: int
    m: int
    ef_construction: int
    model: str
    size: int
    sha256: str

    def differs_from(self, epoch: bytes, dimensions: int, model: str) -> str | None:
        """Why this graph cannot serve a memory of this epoch and settings, or None."""
        theirs = (self.epoch, self.dimensions, self.m, self.ef_construction, self.model)
        ours = (epoch, dimensions, DEFAULT_PARAMS.m, DEFAULT_PARAMS.ef_construction, model)
        if theirs == ours:
            return None
        return f"(epoch, dimensions, m, efConstruction, model) are {theirs}, here {ours}"


@dataclass(frozen=True, slots=True)
class GraphCover:
    """What a graph to publish covers: the memory's epoch it was built in, the log ordinal
    of its first entry, its count, dimensions and model."""

    epoch: bytes
    first_ordinal: int
    count: int
    dimensions: int
    model: str

    def replaces(self, published: GraphDescription | None, unusable: str | None) -> bool:
        """The rule of when to publish (module docstring)."""
        return (
            published is None
            or published.token == unusable
            or published.differs_from(self.epoch, self.dimensions, self.model) is not None
            or (self.first_ordinal + self.count) - (published.first_ordinal + published.count)
            >= REPUBLISH_SHARE * self.count
        )


class SharedGraph:
    """The Redis I/O of the published graph (the module's docstring); every call may raise
    redis-py's errors, OSError or TimeoutError (each bounded by `timeout_s`)."""

    def __init__(self, client: Redis, prefix: str, timeout_s: float, publish_script: str) -> None:
        self._client = client
        self._timeout_s = timeout_s
        self.described_key = f"{prefix}novelty:graph"
        self.chunk_prefix = f"{prefix}novelty:graph:"
        self._lease = f"{prefix}novelty:graph:lease"
        self._meta = f"{prefix}novelty:meta"
        self._publish = client.register_script(publish_script)

    async def described(self) -> GraphDescription | None:
        """The published graph's description; None when there is none (or it is unreadable)."""
        async with asyncio.timeout(self._timeout_s):
            fields = await self._client.hgetall(self.described_key)
        if not fields:
            return None
        f = {_text(k): _raw(v) for k, v in fields.items()}
        try:
            return GraphDescription(
                token=f["token"].decode(),
                chunks=int(f["chunks"]),
                epoch=f["epoch"],
                first_ordinal=int(f["first_ordinal"]),
                count=int(f["count"]),
                dimensions=int(f["dimensions"]),
                m=int(f["m"]),
                ef_construction=int(f["ef_construction"]),
                model=f["model"].decode(),
                size=int(f["bytes"]),
                sha256=f["sha256"].decode(),
            )
        except (KeyError, ValueError, UnicodeDecodeError):
            return None

    async def publish(
        self, data: bytes | bytearray, cover: GraphCover, unusable: str | None = None
    ) -> str:
        """Publishes the graph if the rule says so (or the published one's token is
        `unusable`: it was found damaged); returns what happened: published, not_needed,
        busy (another replica publishes), lost_lease or stale (a reset)."""
        if not cover.replaces(await self.described(), unusable):
            return "not_needed"
        token = uuid.uuid4().hex
        async with asyncio.timeout(self._timeout_s):
            if not await self._client.set(self._lease, token, nx=True, px=LEASE_MS):
                return "busy"
        # Views, not copies: slicing a million entries' 0.9 GB at once would double it and
        # hold the event loop for the copy.
        view = memoryview(data)
        chunks = range(0, len(data), CHUNK)
        try:
            for i, at in enumerate(chunks):
                async with asyncio.timeout(self._timeout_s):
                    await self._client.set(f"{self.chunk_prefix}{token}:{i}", view[at : at + CHUNK])
            digest = await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
            description: dict[str, str | bytes | int] = {
                "token": token,
                "chunks": len(chunks),
                "epoch": cover.epoch,
                "first_ordinal": cover.first_ordinal,
                "count": cover.count,
                "dimensions": cover.dimensions,
                "m": DEFAULT_PARAMS.m,
                "ef_construction": DEFAULT_PARAMS.ef_construction,
                "model": cover.model,
                "bytes": len(data),
                "sha256": digest,
            }
            args: list[str | bytes | int] = [token, cover.epoch, self.chunk_prefix]
            for key, value in description.items():
                args += [key, value]
            async with asyncio.timeout(self._timeout_s):
                outcome = await self._publish(
                    keys=[self.described_key, self._lease, self._meta], args=args
                )
            outcome = outcome.decode()
        except BaseException:
            await self._forget(token, len(chunks))
            raise
        if outcome != "ok":
            await self._forget(token, len(chunks))
            return str(outcome)
        return "published"

    async def would_publish(self, cover: GraphCover, unusable: str | None = None) -> bool:
        """Whether publish would publish such a graph now (asked before serializing one:
        0.9 GB and seconds of a core at a million entries): the rule says so and no other
        replica holds the lease."""
        if not cover.replaces(await self.described(), unusable):
            return False
        async with asyncio.timeout(self._timeout_s):
            return not await self._client.exists(self._lease)

    async def download(self, about: GraphDescription) -> bytearray:
        """The described graph's bytes; ValueError when they are missing or damaged. Copied
        into one buffer a chunk at a time (a million entries' graph is 0.9 GB: not twice)."""
        data = bytearray(about.size)
        at = 0
        for i in range(about.chunks):
            async with asyncio.timeout(self._timeout_s):
                part = await self._client.get(f"{self.chunk_prefix}{about.token}:{i}")
            if part is None:
                raise ValueError(f"chunk {i} of {about.chunks} is gone (replaced or reset)")
            if at + len(part) > about.size:
                raise ValueError("its chunks hold more bytes than described")
            data[at : at + len(part)] = _raw(part)
            at += len(part)
        digest = await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
        if at != about.size or digest != about.sha256:
            raise ValueError("its bytes do not match their checksum")
        return data

    async def _forget(self, token: str, chunks: int) -> None:
        """Best effort: a failed publish's chunks (and lease) do not stay in Redis."""
        keys = [f"{self.chunk_prefix}{token}:{i}" for i in range(chunks)]
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(self._timeout_s):
                if keys:
                    await self._client.delete(*keys)
                if await self._client.get(self._lease) == token.encode():
                    await self._client.delete(self._lease)


def _raw(value: bytes | str) -> bytes:
    # The client returns bytes (no decode_responses); typed as either.
    return value if isinstance(value, bytes) else value.encode()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
