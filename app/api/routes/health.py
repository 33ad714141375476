"""Liveness, readiness and metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.api.deps import ServicesDep
from app.api.mcp import McpHost
from app.api.presenters import backend_out, snapshot_out, storage_out
from app.api.routes.cache import embedder_out
from app.core.version import VERSION
from app.schemas.responses import HealthOut, ReadyOut, RootOut

router = APIRouter(tags=["health"])

_ALIVE = HealthOut(status="ok", version=VERSION)
_ROOT = RootOut(
    service="kp-scoring",
    version=VERSION,
    docs="/docs",
    redoc="/redoc",
    openapi="/openapi.json",
    health="/healthz",
    ready="/readyz",
)


@router.get("/", summary="Where to start: links to the documentation and the probes")
async def root() -> RootOut:
    # A small JSON answer rather than a redirect: it reads the same in a browser and in curl,
    # and the links are relative to wherever the service is mounted.
    return _ROOT


@router.get("/healthz", summary="Liveness: the process answers")
async def healthz() -> HealthOut:
    return _ALIVE


@router.get("/readyz", summary="Readiness, with the embedder's and the cache's state")
async def readyz(services: ServicesDep, request: Request) -> ReadyOut:
    health = services.runtime.health()
    mcp: McpHost | None = getattr(request.app.state, "mcp", None)
    mcp_warnings = mcp.health().warnings if mcp is not None else ()
    storage = storage_out(services.runtime.storage_status())
    return ReadyOut(
        status="degraded" if health.degraded else "ready",
        degraded=health.degraded,
        embedder=embedder_out(services),
        cache_size=services.memory.size,
        cache_backend=backend_out(services.memory.backend),
        admin_auth=not services.settings.cache_open,
        storage=storage,
        snapshot=snapshot_out(storage),
        warnings=[*health.warnings, *mcp_warnings],
    )


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(services: ServicesDep) -> Response:
    return Response(generate_latest(services.metrics.registry), media_type=CONTENT_TYPE_LATEST)
