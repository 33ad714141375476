"""The app, built in one place from Settings: routes, the request pipeline in the order a
request meets it, and the lifespan that starts the runtime (app/serve.py serves it)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline
from starlette.middleware import Middleware

from app.api import mcp, openapi_doc
from app.api.asgi.access_log import AccessLog
from app.api.asgi.api_keys import ApiKeys
from app.api.asgi.body_limits import BodySize, JsonDepth
from app.api.asgi.content_type import ContentType
from app.api.asgi.idempotency import IdempotencyKeys
from app.api.asgi.lingering_close import LingeringClose
from app.api.asgi.namespaces import Namespaces
from app.api.asgi.rate_limit import RateLimit
from app.api.asgi.request_bounds import RequestBounds
from app.api.asgi.request_id import RequestId
from app.api.deps import Services
from app.api.errors import install_error_handlers
from app.api.routes import cache, contribution, evaluate, health, jwks
from app.core.config import Settings
from app.core.metrics import Metrics
from app.core.version import VERSION
from app.embedding.int8_support import CpuFeatures
from app.guards.api_keys import KeyRing
from app.schemas.limits import TraceLimits
from app.server.descriptors import watch_descriptors
from app.service.runtime import Runtime
from app.service.trust import load_keys, load_signer


def create_app(
    settings: Settings, *, cpu: CpuFeatures | None = None, url: str | None = None
) -> FastAPI:
    """`settings`: read from the environment by the launcher (app/serve.py) or given by a
    test. `cpu`: the CPU int8 mode decides on (default: this machine's; tests pass another).
    `url`: where the launcher serves it, for the start's log line."""
    metrics = Metrics(namespace_labels=settings.metrics_namespaces)
    limits = TraceLimits(settings.max_batch, settings.max_steps, settings.max_string_chars)
    # Bad key files stop the start here, naming the variable, before anything is served.
    keys = load_keys(settings)
    signer = load_signer(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtime = Runtime(settings, cpu, observer=metrics)
        await runtime.start(url)
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
        middleware=pipeline(settings, metrics, keys),
    )
    for router in (
        evaluate.router,
        contribution.router,
        mcp.router,
        cache.router,
        health.router,
        jwks.router,
    ):
        app.include_router(router)
    install_error_handlers(app)
    openapi_doc.install(app, settings)
    return app


def pipeline(settings: Settings, metrics: Metrics, keys: KeyRing) -> list[Middleware]:
    """The request pipeline, outermost first. The request's own bounds (Host, body deadline)
    come before keys and limits; keys, the namespace and limits before the body is read, so a
    refused request costs a header lookup; the body's limits before any parsing; the
    idempotency record before the route parses and scores the trace."""
    return [
        Middleware(RequestId),
        Middleware(AccessLog, metrics=metrics),
        Middleware(RequestBounds, body_timeout_s=settings.body_timeout_s),
        Middleware(LingeringClose),
        Middleware(
            ApiKeys,
            keys=keys,
            evaluate_open=settings.scoring_open,
            admin_open=settings.cache_open,
            metrics=metrics,
        ),
        Middleware(Namespaces, metrics=metrics),
        Middleware(RateLimit, metrics=metrics),
        Middleware(ContentType),
        Middleware(BodySize, max_body_bytes=settings.max_body_bytes),
        Middleware(JsonDepth, max_json_depth=settings.max_json_depth),
        Middleware(IdempotencyKeys, metrics=metrics),
    ]
