"""Where to start, liveness, readiness, metrics and the signing keys."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.api.deps import ServiceDep
from app.core.version import VERSION
from app.schemas.responses import HealthOut, JwksOut, ReadyOut, RootOut

router = APIRouter()

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


@router.get(
    "/", tags=["health"], summary="Where to start: links to the documentation and the probes"
)
async def root() -> RootOut:
    # A small JSON answer rather than a redirect: it reads the same in a browser and in curl,
    # and the links are relative to wherever the service is mounted.
    return _ROOT


@router.get("/healthz", tags=["health"], summary="Liveness: the process answers")
async def healthz() -> HealthOut:
    return _ALIVE


@router.get(
    "/readyz", tags=["health"], summary="Readiness, with the embedder's and the cache's state"
)
async def readyz(service: ServiceDep, request: Request) -> ReadyOut:
    mcp = getattr(request.app.state, "mcp", None)
    return service.ready(*(() if mcp is None else (mcp.health(),)))


@router.get("/metrics", tags=["health"], summary="Prometheus metrics", response_class=Response)
async def metrics(service: ServiceDep) -> Response:
    return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get(
    "/.well-known/jwks.json", tags=["signatures"], summary="Public keys of signed scores (JWKS)"
)
async def jwks(service: ServiceDep) -> JwksOut:
    return service.jwks()
