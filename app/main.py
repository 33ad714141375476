"""The app, wired in one place from Settings: the routes, the two pieces of middleware, the
error handlers, and the lifespan that starts the parts and the service. `app` is what ASGI
servers serve, built from the environment (KP_*; docs/operating/servers.md); `create_app`
builds one from given settings (the tests, the OpenAPI export).
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.telemetry import TelemetryConfig
from fastapi_offline import FastAPIOffline
from opentelemetry import trace
from starlette.middleware import Middleware

from app.api import mcp, openapi_doc
from app.api.edge import Admission, Edge
from app.api.errors import install_error_handlers
from app.api.routes import cache, evaluate, health
from app.core.config import Settings
from app.core.logging import configure_logging
from app.core.metrics import Metrics
from app.core.version import VERSION
from app.embedding.int8_support import CpuFeatures
from app.server.descriptors import watch_descriptors
from app.service.runtime import Runtime
from app.service.scoring_service import ScoringService
from app.service.trust import load_keys, load_signer


def create_app(
    settings: Settings | None = None,
    *,
    cpu: CpuFeatures | None = None,
    telemetry: TelemetryConfig | None = None,
) -> FastAPI:
    """`settings`: None reads them from the environment. `cpu`: the CPU int8 mode decides on
    (default: this machine's; tests pass another). `telemetry`: FastAPI's OpenTelemetry
    settings over these defaults: the standard OTEL_* variables configure the export (OTLP),
    and nothing is traced unless an exporter is (docs/operating/tracing.md)."""
    telemetry = {"auto_configure": True, **(telemetry or {})}
    from_environment = settings is None
    if settings is None:
        settings = Settings.from_env()
    metrics = Metrics(namespace_labels=settings.metrics_namespaces)
    # Bad key files stop the start here, naming the variable, before anything is served.
    keys = load_keys(settings)
    signer = load_signer(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if from_environment:  # served: JSON lines on stderr (a test's app logs as pytest says)
            configure_logging(settings.log_level)
        runtime = Runtime(settings, cpu, observer=metrics)
        # FastAPI configured the export from OTEL_* before this start; unconfigured, the
        # provider is the API's proxy and nothing is traced (nor costs a span).
        provider = telemetry.get("tracer_provider") or trace.get_tracer_provider()
        tracer = None
        if telemetry.get("tracing", True) and not isinstance(provider, trace.ProxyTracerProvider):
            tracer = provider.get_tracer("kp-scoring", VERSION)
        runtime.evaluator.tracer = runtime.embeddings.tracer = tracer
        await runtime.start(getattr(app.state, "url", None))
        metrics.registry.register(runtime)
        service = ScoringService(settings, runtime, metrics, keys, signer, tracer)
        app.state.service = service
        app.state.mcp = mcp.McpHost(service)
        if settings.embedder_preload:
            await app.state.mcp.transport()
        descriptors = asyncio.create_task(watch_descriptors())
        if not gc.isenabled():  # app/serve.py stopped the collector for the start
            # What the start made lives as long as the process: out of the collector's way
            # (docs/decisions/collector-off-during-start.md), then the collector on again.
            gc.freeze()
            gc.enable()
        try:
            yield
        finally:
            descriptors.cancel()
            await app.state.mcp.stop()
            app.state.mcp = None
            metrics.registry.unregister(runtime)
            await runtime.stop()
            # A stopped app lets go of its model and memory: fastapi caches endpoint
            # functions (closures that hold the app) for the life of the process.
            del app.state.service

    # /docs and /redoc load their JS and CSS from the service, not a CDN: they work offline.
    app = FastAPIOffline(
        title="kp-scoring",
        version=VERSION,
        summary="KnowledgePulse trace scoring: is this reasoning trace worth sharing?",
        lifespan=lifespan,
        middleware=pipeline(settings, metrics),
        telemetry=telemetry,
    )
    app.state.settings = settings
    for router in (evaluate.router, mcp.router, cache.router, health.router):
        app.include_router(router)
    install_error_handlers(app)
    openapi_doc.install(app, settings)
    return app


def pipeline(settings: Settings, metrics: Metrics) -> list[Middleware]:
    """Outermost first: the request's edge (its id, the log, Host, the body's deadline), then
    who asks and the body's limits, before a route parses anything."""
    return [
        Middleware(Edge, metrics=metrics, body_timeout_s=settings.body_timeout_s),
        Middleware(
            Admission,
            max_body_bytes=settings.max_body_bytes,
            max_json_depth=settings.max_json_depth,
        ),
    ]


app = create_app()
