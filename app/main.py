"""The ASGI app: `uvicorn app.main:app`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from fastapi_offline import FastAPIOffline

from app import __version__
from app.api import mcp
from app.api.deps import Services
from app.api.errors import install_error_handlers
from app.api.middleware import RequestGuard
from app.api.routes import cache, evaluate, health
from app.core.config import Settings, redis_location
from app.core.logging import configure_logging
from app.core.metrics import Metrics
from app.core.states import Precision
from app.domain.vector_cache import VectorCache
from app.embedding import model_files
from app.embedding.int8_support import CpuFeatures, Int8Support, int8_support
from app.embedding.onnx_embedder import ModelError, OnnxEmbedder
from app.schemas.limits import TraceLimits
from app.services.embeddings import EmbeddingService
from app.services.evaluator import Evaluator
from app.services.snapshots import SnapshotStore
from app.store.in_process import InProcessMemory

if TYPE_CHECKING:
    from app.store.redis_shared import RedisSharedMemory

log = logging.getLogger("app")


def _load_embedder(
    files: model_files.ModelFiles, settings: Settings, int8: Int8Support | None
) -> OnnxEmbedder:
    model_files.verify(files)
    # The least a first answer needs: the embedding service finishes loading after it (or
    # before the service reports ready, with KP_EMBEDDER_PRELOAD).
    return OnnxEmbedder(
        files.model,
        files.tokenizer,
        intra_op_threads=settings.embedder_threads,
        concurrent_runs=settings.embedder_worker_count,
        precision="float32" if int8 is None else int8.precision,
        int8_weights=None if int8 is None else int8.weights,
        defer=True,
    )


def _int8_support(settings: Settings, cpu: CpuFeatures | None) -> Int8Support | None:
    """With KP_EMBEDDER_PRECISION=int8: whether this CPU keeps int8 mode's promise (logged)."""
    if settings.embedder_precision != "int8":
        return None
    support = int8_support(cpu)
    if support.weights is None:
        log.warning(
            "int8 mode declined: the embedder runs float32", extra={"reason": support.reason}
        )
    else:
        log.info("int8 mode", extra={"weights": support.weights, "reason": support.reason})
    return support


def build_embeddings(
    settings: Settings, cpu: CpuFeatures | None = None
) -> tuple[EmbeddingService, model_files.ModelFiles | None]:
    """The embedding service the settings ask for (its model loads later), and its files;
    `cpu` (default: this machine's) decides whether int8 mode runs."""
    if settings.embedder == "none":
        return EmbeddingService(None, model_name=None), None
    try:
        files = model_files.resolve(settings.model_path, settings.tokenizer_path)
    except ModelError as exc:
        service = EmbeddingService(None, model_name=None)
        service.mark_unavailable(str(exc))
        return service, None
    int8 = _int8_support(settings, cpu)
    service = EmbeddingService(
        partial(_load_embedder, files, settings, int8),
        model_name=files.name,
        precision="float32" if int8 is None else int8.precision,
        precision_reason=None if int8 is None else int8.reason,
        workers=settings.embedder_worker_count,
        batch_size=settings.embed_batch_size,
        queue_limit=settings.embed_queue_limit,
        max_wait_ms=settings.embed_max_wait_ms,
    )
    return service, files


def build_memory(
    settings: Settings, files: model_files.ModelFiles | None, precision: Precision | None
) -> InProcessMemory | RedisSharedMemory:
    """The novelty memory the settings ask for: this process's, or the one shared through
    KP_REDIS_URL (connected by its start()); `precision` as for build_snapshots."""
    if settings.redis_url is None:
        return InProcessMemory(VectorCache(settings.cache_capacity, ttl_ms=settings.cache_ttl_ms))
    model_id = None
    if files is not None:
        try:
            model_id = model_files.identity(files, precision or "float32")
        except ModelError as exc:
            log.error("shared cache: model identity unknown", extra={"reason": str(exc)})
    from app.store.redis_shared import RedisSharedMemory  # redis is slow to import; only here

    url = settings.redis_url.get_secret_value()
    return RedisSharedMemory(
        url,
        redis_location(url),
        prefix=settings.redis_prefix,
        capacity=settings.cache_capacity,
        ttl_ms=settings.cache_ttl_ms,
        timeout_ms=settings.redis_timeout_ms,
        model=model_id,
    )


def build_snapshots(
    settings: Settings,
    cache: VectorCache,
    files: model_files.ModelFiles | None,
    precision: Precision | None,
) -> SnapshotStore:
    """`precision`: what the embedder runs (float32 where int8 mode declined)."""
    model_id = None
    if settings.cache_snapshot_path is not None and files is not None:
        try:
            model_id = model_files.identity(files, precision or "float32")
        except ModelError as exc:
            log.error("cache snapshots off: model identity unknown", extra={"reason": str(exc)})
    return SnapshotStore(settings.cache_snapshot_path, cache, model_id)


async def _save_periodically(snapshots: SnapshotStore, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        await run_in_threadpool(snapshots.save)


def create_app(settings: Settings | None = None, *, cpu: CpuFeatures | None = None) -> FastAPI:
    """`cpu`: the CPU int8 mode decides on (default: this machine's; tests pass another)."""
    settings = settings or Settings.from_env()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        embeddings, files = build_embeddings(settings, cpu)
        embeddings.observe(metrics)
        memory = build_memory(settings, files, embeddings.precision)
        # Snapshots are the in-process memory's persistence; with Redis, Redis's (AOF), and
        # the settings refuse KP_CACHE_SNAPSHOT_PATH.
        local = memory.cache if isinstance(memory, InProcessMemory) else memory.mirror
        snapshots = build_snapshots(settings, local, files, embeddings.precision)
        await run_in_threadpool(snapshots.restore)
        await memory.start()
        app.state.services = Services(
            settings,
            memory,
            embeddings,
            Evaluator(memory, embeddings),
            metrics,
            snapshots,
            TraceLimits(settings.max_batch, settings.max_steps, settings.max_string_chars),
        )
        if settings.admin_token is None:
            log.warning("KP_ADMIN_TOKEN is not set: GET and DELETE /cache are open to every caller")
        if settings.embedder_preload:
            await embeddings.preload()
        backend = memory.backend
        log.info(
            "kp-scoring started",
            extra={
                "embedder": embeddings.state.value,
                "cache_capacity": settings.cache_capacity,
                "cache": backend.location or backend.kind,
            },
        )
        app.state.mcp = mcp.McpTransport(app.state.services)
        await app.state.mcp.start()
        saver = asyncio.create_task(
            _save_periodically(snapshots, settings.cache_snapshot_interval_s)
        )
        try:
            yield
        finally:
            saver.cancel()
            await app.state.mcp.stop()
            app.state.mcp = None
            await embeddings.close()
            await run_in_threadpool(snapshots.save)
            await memory.close()
            log.info("kp-scoring stopped", extra={"cache_size": memory.size})

    # FastAPI, with /docs and /redoc loading their JS and CSS from the service, not a CDN:
    # they work in a closed network.
    app = FastAPIOffline(
        title="kp-scoring",
        version=__version__,
        summary="KnowledgePulse trace scoring: is this reasoning trace worth sharing?",
        lifespan=lifespan,
    )
    for router in (evaluate.router, mcp.router, cache.router, health.router):
        app.include_router(router)
    install_error_handlers(app)
    app.add_middleware(
        RequestGuard,
        metrics=metrics,
        max_body_bytes=settings.max_body_bytes,
        max_json_depth=settings.max_json_depth,
    )
    return app


def _app_from_env() -> FastAPI:
    settings = Settings.from_env()
    configure_logging(settings.log_level)
    return create_app(settings)


app = _app_from_env()
