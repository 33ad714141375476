"""The parts a running service holds (embeddings, novelty memory and its database, evaluator),
built from Settings, started and stopped in order; what they report to /readyz and /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from app.core.config import Settings, default_memory_file, redis_location, retired_settings
from app.core.health import UNMEASURED, Health
from app.core.states import EmbedderState, StorageState
from app.embedding import model_files
from app.embedding.embeddings import EmbeddingMemo, EmbeddingService
from app.embedding.int8_support import CpuFeatures, Int8Support, int8_support
from app.embedding.onnx_embedder import ModelError, OnnxEmbedder
from app.embedding.session_cache import SessionCache
from app.embedding.types import EmbedObserver
from app.memory import summary as memory_summary
from app.memory.base import NoveltyMemory
from app.memory.in_process import InProcessMemory
from app.memory.sqlite import SqliteStore
from app.memory.sqlite_rows import StorageStatus
from app.service.evaluator import Evaluator
from app.service.trust import build_guards

log = logging.getLogger("app")


class Runtime(Collector):
    """`cpu`: the CPU int8 mode decides on (default: this machine's); `observer`: where the
    embedder's queue waits and model run times go (the metrics)."""

    def __init__(
        self,
        settings: Settings,
        cpu: CpuFeatures | None = None,
        observer: EmbedObserver | None = None,
    ) -> None:
        self.settings = settings
        self.embeddings, files = build_embeddings(settings, cpu)
        if observer is not None:
            self.embeddings.scheduler.observer = observer
        # Vectors are comparable only with vectors of the same model and arithmetic: the
        # shared memory and the database both carry this identity.
        needs_identity = settings.redis_url is not None or settings.cache_db_path is not None
        model_id = None
        if needs_identity and files is not None:
            try:
                model_id = model_files.identity(files, self.embeddings.precision or "float32")
            except ModelError as exc:  # then nothing shares or saves vectors
                log.error(
                    "model identity unknown: no shared cache exchange or stored vector can be "
                    "trusted",
                    extra={"reason": str(exc)},
                )
        self.memory = build_memory(settings, model_id)
        self.memo = EmbeddingMemo(self.embeddings, settings.embed_memo_capacity)
        self.evaluator = Evaluator(self.memory, self.memo)
        self.rate_limiter, self.idempotency, self._guards_redis = build_guards(settings)

    async def start(self, url: str | None = None) -> None:
        """`url`: where the server listens, for the start's log line."""
        for warning in [*self.settings.deprecation_warnings(), *retired_settings()]:
            log.warning(warning)
        if self.settings.cache_db_path is not None and self.store is None:
            log.error(
                "the model identity is unknown: the cache database is not used, nothing is "
                "stored across restarts",
                extra={"path": str(self.settings.cache_db_path)},
            )
        if self.settings.embedder_preload:
            # Independent: the memory's load (its database, off the loop) beside the model's.
            await asyncio.gather(self.memory.start(), self.embeddings.preload())
        else:
            await self.memory.start()
        if self.settings.api_keys_file is not None:
            log.info("API keys required", extra={"file": str(self.settings.api_keys_file)})
        if self.settings.cache_open:
            log.warning("KP_ADMIN_TOKEN is not set: GET and DELETE /cache are open to every caller")
        log.info(
            "kp-scoring started",
            extra={
                "url": url,
                "embedder": self.embeddings.state.value,
                "cache_capacity": self.settings.cache_capacity,
                **memory_summary.at_start(self.memory),
            },
        )

    async def stop(self) -> None:
        await self.embeddings.close()
        await self.memory.close()
        if self._guards_redis is not None:
            await self._guards_redis.aclose()
        log.info("kp-scoring stopped", extra=memory_summary.at_stop(self.memory))

    def health(self) -> Health:
        """Every part's report, in one: degraded when any part is."""
        warnings: list[str] = []
        if self.settings.cache_open:
            warnings.append("KP_ADMIN_TOKEN is not set: /cache is open to every caller")
        unmeasured = self.embeddings.degraded
        if unmeasured:
            warnings.append(UNMEASURED + (self.embeddings.reason or ""))
        memory = self.memory.health()
        warnings += memory.warnings
        if self.settings.cache_db_path is not None and self.store is None:
            warnings.append("cache database not used: the model identity is unknown")
        return Health(degraded=unmeasured or memory.degraded, warnings=tuple(warnings))

    @property
    def store(self) -> SqliteStore | None:
        """The in-process memory's database, when it has one."""
        return self.memory.store if isinstance(self.memory, InProcessMemory) else None

    def storage_status(self) -> StorageStatus:
        store = self.store
        if store is not None:
            return store.status
        return StorageStatus(self.settings.cache_db_path, StorageState.DISABLED)

    def collect(self) -> Iterator[Metric]:
        """The parts' own figures, read at each scrape. The running totals live in the parts
        (the shared memory's evictions even in Redis, counted by every replica), so they are
        exposed as counters from there rather than mirrored into prometheus objects by hand."""
        embeddings, memory = self.embeddings, self.memory
        backend = memory.backend
        yield GaugeMetricFamily("kp_cache_size", "Vectors in the novelty cache.", memory.size)
        yield CounterMetricFamily(
            "kp_cache_evictions",
            "Vectors evicted from the cache (oldest first); shared: by every replica.",
            memory.evictions_total,
        )
        yield GaugeMetricFamily(
            "kp_cache_available",
            "1 while the cache can be used; 0 while the shared cache's Redis is unreachable "
            "(novelty not measured, reason cache_unavailable).",
            1 if backend.available else 0,
        )
        yield CounterMetricFamily(
            "kp_cache_outages",
            "Times the shared cache's Redis became unreachable since start.",
            backend.outages_total,
        )
        state = GaugeMetricFamily(
            "kp_embedder_state", "1 for the embedder's current state.", labels=["state"]
        )
        for each in EmbedderState:
            state.add_metric([each.value], 1 if embeddings.state is each else 0)
        yield state
        yield GaugeMetricFamily(
            "kp_embed_queue_depth", "Texts waiting for the model.", embeddings.scheduler.queue_depth
        )
        runs = CounterMetricFamily(
            "kp_embed_runs",
            "Model calls since start (three warm-ups at load): a request alone on all cores, "
            "or side by side on one.",
            labels=["cores"],
        )
        for cores, count in embeddings.scheduler.runs_total.items():
            runs.add_metric([cores], count)
        yield runs
        memo = CounterMetricFamily(
            "kp_embed_memo",
            "Texts looked up in the memo of recent vectors, by result (hit: no model run).",
            labels=["result"],
        )
        memo.add_metric(["hit"], self.memo.hits_total)
        memo.add_metric(["miss"], self.memo.misses_total)
        yield memo
        storage = self.storage_status()
        yield CounterMetricFamily(
            "kp_cache_db_commits",
            "Transactions committed to the in-process memory's database since start (a group "
            "of concurrent traces is one).",
            storage.commits_total,
        )
        yield CounterMetricFamily(
            "kp_cache_db_write_errors",
            "Writes the in-process memory's database refused since start (disk full, "
            "read-only, I/O error): their traces were scored but not stored.",
            storage.write_errors_total,
        )
        yield CounterMetricFamily(
            "kp_cache_db_checksum_failures",
            "Entries of the database that failed their checksum at start: dropped, never served.",
            storage.checksum_failures_total,
        )
        yield GaugeMetricFamily(
            "kp_cache_db_failing",
            "1 while the in-process memory's database takes no commit (it cannot be opened, or "
            "its last write failed): traces are scored but not stored.",
            1 if storage.failing else 0,
        )
        yield CounterMetricFamily(
            "kp_cache_db_rewrites",
            "Times the database was written anew from the memory because its file or WAL was "
            "deleted or replaced while serving.",
            storage.rewrites_total,
        )
        faults = memory.faults
        yield CounterMetricFamily(
            "kp_cache_not_stored",
            "Traces scored but not stored because the memory refused to keep them (the shared "
            "memory's Redis may evict keys); the database's refusals: kp_cache_db_write_errors.",
            faults.not_stored_total,
        )
        yield GaugeMetricFamily(
            "kp_cache_eviction_unsafe",
            "1 while the shared memory's Redis runs a maxmemory-policy that may evict its keys "
            "(allkeys-*): no trace is stored until it is noeviction.",
            1 if faults.eviction_unsafe else 0,
        )
        yield GaugeMetricFamily(
            "kp_cache_namespaces_unavailable",
            "Namespaces of the shared memory refused now for their own index (missing and "
            "being rebuilt, or another's); the others answer.",
            faults.namespaces_unavailable,
        )
        yield CounterMetricFamily(
            "kp_cache_index_rebuilds",
            "Namespace indexes this replica made again in Redis after they went missing.",
            faults.index_rebuilds_total,
        )


def load_embedder(
    files: model_files.ModelFiles, settings: Settings, int8: Int8Support | None
) -> OnnxEmbedder:
    """The least a first answer needs: the embedding service finishes loading after it (or
    before the service reports ready, with KP_EMBEDDER_PRELOAD)."""
    directory = settings.model_cache_location
    cache = None if directory is None else SessionCache(directory)
    # The file's hash (hashlib leaves the GIL) runs beside the tokenizer's load.
    with ThreadPoolExecutor(1, thread_name_prefix="kp-model-check") as check:
        sha256 = check.submit(model_files.verify, files)
        return OnnxEmbedder(
            files.model,
            files.tokenizer,
            intra_op_threads=settings.embedder_threads,
            spinning=settings.embedder_spinning,
            concurrent_runs=settings.embedder_worker_count,
            precision="float32" if int8 is None else int8.precision,
            int8_weights=None if int8 is None else int8.weights,
            defer=True,
            session_cache=cache,
            model_sha256=sha256.result,
        )


def build_embeddings(
    settings: Settings, cpu: CpuFeatures | None = None
) -> tuple[EmbeddingService, model_files.ModelFiles | None]:
    """The embedding service the settings ask for (its model loads on the first request, or
    at start with KP_EMBEDDER_PRELOAD), and its files."""
    if settings.embedder == "none":
        return EmbeddingService(None, model_name=None), None
    try:
        files = model_files.resolve(settings.model_path, settings.tokenizer_path)
    except ModelError as exc:
        service = EmbeddingService(None, model_name=None)
        service.mark_unavailable(str(exc))
        return service, None
    int8 = None
    if settings.embedder_precision == "int8":  # whether this CPU keeps int8 mode's promise
        int8 = int8_support(cpu)
        if int8.weights is None:
            reason = {"reason": int8.reason}
            log.warning("int8 mode declined: the embedder runs float32", extra=reason)
        else:
            log.info("int8 mode", extra={"weights": int8.weights, "reason": int8.reason})
    service = EmbeddingService(
        partial(load_embedder, files, settings, int8),
        model_name=files.name,
        weights=files.weights,
        precision="float32" if int8 is None else int8.precision,
        precision_reason=None if int8 is None else int8.reason,
        workers=settings.embedder_worker_count,
        batch_size=settings.embed_batch_size,
        queue_limit=settings.embed_queue_limit,
        max_wait_ms=settings.embed_max_wait_ms,
    )
    return service, files


def build_memory(settings: Settings, model_id: str | None) -> NoveltyMemory:
    """This process's memory (kept in KP_CACHE_DB_PATH when set and the model is known), or
    the one shared through KP_REDIS_URL (connected, or loaded, by start())."""
    if settings.redis_url is None:
        path = settings.cache_db_path
        if path is not None and path == default_memory_file():
            # The default database's directory (the user's data directory), made private: one
            # that cannot be made leaves the database unopened, as the log and /readyz say. A
            # KP_CACHE_DB_PATH given is used as it is: a missing directory there is a mistake.
            with contextlib.suppress(OSError):
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        store = None
        if path is not None and model_id is not None:
            store = SqliteStore(path, model_id, 384, settings.cache_durability)
        return InProcessMemory(
            settings.cache_capacity,
            ttl_ms=settings.cache_ttl_ms,
            max_namespaces=settings.max_namespaces,
            store=store,
        )
    from app.memory.redis_vectors import RedisVectorMemory  # redis is slow to import; only here

    url = settings.redis_url.get_secret_value()
    return RedisVectorMemory(
        url,
        redis_location(url),
        prefix=settings.redis_prefix,
        capacity=settings.cache_capacity,
        ttl_ms=settings.cache_ttl_ms,
        timeout_ms=settings.redis_timeout_ms,
        model=model_id,
        max_namespaces=settings.max_namespaces,
        hnsw_from=settings.redis_hnsw_from,
        hnsw_m=settings.redis_hnsw_m,
        hnsw_ef_construction=settings.redis_hnsw_ef_construction,
        hnsw_ef_runtime=settings.redis_hnsw_ef_runtime,
    )
