"""The ASGI app factory: `uvicorn --factory app.main:create_app` (app/serve.py runs it)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline

from app.api import mcp, openapi_doc
from app.api.asgi import pipeline
from app.api.deps import Services
from app.api.errors import install_error_handlers
from app.api.routes import cache, evaluate, health, jwks
from app.core.config import Settings
from app.core.logging import configure_logging
from app.core.metrics import Metrics
from app.core.version import VERSION
from app.embedding.int8_support import CpuFeatures
from app.schemas.limits import TraceLimits
from app.server.descriptors import raise_open_files_limit, watch_descriptors
from app.services.runtime import Runtime
from app.services.trust import load_keys, load_signer


def create_app(settings: Settings | None = None, *, cpu: CpuFeatures | None = None) -> FastAPI:
    """Called by uvicorn with no arguments: settings and logging then come from KP_*
    variables, read now rather than at import. `cpu`: the CPU int8 mode decides on (default:
    this machine's; tests pass another)."""
    if settings is None:
        settings = Settings.from_env()
        configure_logging(settings.log_level)
    metrics = Metrics()
    limits = TraceLimits(settings.max_batch, settings.max_steps, settings.max_string_chars)
    # Bad key files stop the start here, naming the variable, before anything is served.
    keys = load_keys(settings)
    signer = load_signer(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        raise_open_files_limit(settings.open_files_limit)
        runtime = Runtime(settings, cpu, observer=metrics)
        await runtime.start()
        metrics.registry.register(runtime.collector)
        app.state.services = Services(settings, runtime, metrics, limits, signer)
        app.state.mcp = mcp.McpHost(app.state.services)
        if settings.embedder_preload:
            await app.state.mcp.transport()
        descriptors = asyncio.create_task(watch_descriptors())
        if not gc.isenabled():  # app/serve.py stopped the collector for the start
            # What the start made lives as long as the process: out of the collector's way
            # (fewer, shorter collections while serving), then the collector on again.
            gc.freeze()
            gc.enable()
        try:
            yield
        finally:
            descriptors.cancel()
            await app.state.mcp.stop()
            app.state.mcp = None
            metrics.registry.unregister(runtime.collector)
            await runtime.stop()
            # A stopped app lets go of its model and memory: fastapi caches endpoint
            # functions (closures that hold the app) for the life of the process.
            del app.state.services

    # /docs and /redoc load their JS and CSS from the service, not a CDN: they work offline.
    app = FastAPIOffline(
        title="kp-scoring",
        version=VERSION,
        summary="KnowledgePulse trace scoring: is this reasoning trace worth sharing?",
        lifespan=lifespan,
    )
    for router in (evaluate.router, mcp.router, cache.router, health.router, jwks.router):
        app.include_router(router)
    install_error_handlers(app)
    openapi_doc.install(app, settings)
    chain = pipeline.pieces(
        metrics=metrics,
        keys=keys,
        evaluate_open=settings.scoring_open,
        admin_open=settings.cache_open,
        max_body_bytes=settings.max_body_bytes,
        max_json_depth=settings.max_json_depth,
    )
    pipeline.install(app, chain)
    return app
