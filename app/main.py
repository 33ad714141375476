"""The ASGI app: `uvicorn app.main:app`."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

from fastapi import FastAPI

from app import __version__
from app.api.deps import Services
from app.api.errors import install_error_handlers
from app.api.middleware import RequestGuard
from app.api.routes import cache, evaluate, health
from app.core.config import Settings
from app.core.logging import configure_logging
from app.core.metrics import Metrics
from app.domain.vector_cache import VectorCache
from app.embedding import model_files
from app.embedding.onnx_embedder import ModelError, OnnxEmbedder
from app.services.embeddings import EmbedderFactory, EmbeddingService
from app.services.evaluator import Evaluator

log = logging.getLogger("app")


def _load_embedder(files: model_files.ModelFiles, threads: int) -> OnnxEmbedder:
    model_files.verify(files)
    return OnnxEmbedder(files.model, files.tokenizer, intra_op_threads=threads)


def build_embeddings(settings: Settings) -> EmbeddingService:
    """The embedding service the settings ask for; its model loads later (lazily or preloaded)."""
    factory: EmbedderFactory | None = None
    name: str | None = None
    if settings.embedder == "onnx":
        try:
            files = model_files.resolve(settings.model_path, settings.tokenizer_path)
        except ModelError as exc:
            service = EmbeddingService(None, model_name=None)
            service.state, service.reason = service.state.UNAVAILABLE, str(exc)
            log.error("embedder unavailable; novelty is not measured", extra={"reason": str(exc)})
            return service
        factory, name = partial(_load_embedder, files, settings.embedder_threads), files.name
    return EmbeddingService(
        factory,
        model_name=name,
        batch_size=settings.embed_batch_size,
        queue_limit=settings.embed_queue_limit,
    )


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings.from_env()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        cache = VectorCache(settings.cache_capacity, ttl_ms=settings.cache_ttl_ms)
        embeddings = build_embeddings(settings)
        app.state.services = Services(
            settings, cache, embeddings, Evaluator(cache, embeddings), metrics
        )
        if settings.admin_token is None:
            log.warning("KP_ADMIN_TOKEN is not set: GET and DELETE /cache are open to every caller")
        if settings.embedder_preload:
            await embeddings.load()
        log.info(
            "kp-scoring started",
            extra={"embedder": embeddings.state.value, "cache_capacity": settings.cache_capacity},
        )
        try:
            yield
        finally:
            await embeddings.close()
            log.info("kp-scoring stopped")

    app = FastAPI(
        title="kp-scoring",
        version=__version__,
        summary="KnowledgePulse trace scoring: is this reasoning trace worth sharing?",
        lifespan=lifespan,
    )
    for router in (evaluate.router, cache.router, health.router):
        app.include_router(router)
    install_error_handlers(app)
    app.add_middleware(RequestGuard, metrics=metrics, max_body_bytes=settings.max_body_bytes)
    return app


def _app_from_env() -> FastAPI:
    settings = Settings.from_env()
    configure_logging(settings.log_level)
    return create_app(settings)


app = _app_from_env()
