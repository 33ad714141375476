"""Liveness, readiness and metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.api.deps import ServicesDep
from app.api.presenters import backend_out, snapshot_out
from app.api.routes.cache import embedder_out
from app.core.states import EmbedderState, SnapshotState
from app.schemas.responses import HealthOut, ReadyOut

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness: the process answers")
async def healthz() -> HealthOut:
    return HealthOut(status="ok")


@router.get("/readyz", summary="Readiness, with the embedder's and the cache's state")
async def readyz(services: ServicesDep) -> ReadyOut:
    backend = services.memory.backend
    degraded = services.embeddings.degraded or not backend.available
    warnings = []
    if services.settings.admin_token is None:
        warnings.append("KP_ADMIN_TOKEN is not set: /cache is open to every caller")
    if services.embeddings.degraded:
        warnings.append(
            "novelty is not measured (fixed at 0.5): " + (services.embeddings.reason or "")
        )
    if not backend.available:
        warnings.append(
            f"novelty is not measured (fixed at 0.5): the shared cache at {backend.location} "
            f"is unavailable: {backend.reason}"
        )
    snapshot = services.snapshots.status
    if snapshot.state in (SnapshotState.SET_ASIDE, SnapshotState.ERROR):
        warnings.append(f"cache snapshot {snapshot.state.value}: {snapshot.detail}")
    if snapshot.last_save_error is not None:
        warnings.append(f"cache snapshot not saved: {snapshot.last_save_error}")
    return ReadyOut(
        status="degraded" if degraded else "ready",
        degraded=degraded,
        embedder=embedder_out(services),
        cache_size=services.memory.size,
        cache_backend=backend_out(backend),
        admin_auth=services.settings.admin_token is not None,
        snapshot=snapshot_out(snapshot),
        warnings=warnings,
    )


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(services: ServicesDep) -> Response:
    m = services.metrics
    backend = services.memory.backend
    m.cache_size.set(services.memory.size)
    m.cache_evictions.set(services.memory.evictions_total)
    m.cache_available.set(1 if backend.available else 0)
    m.cache_outages.set(backend.outages_total)
    m.queue_depth.set(services.embeddings.queue_depth)
    for cores, runs in services.embeddings.runs_total.items():
        m.embed_runs.labels(cores).set(runs)
    m.snapshot_save_errors.set(services.snapshots.status.save_errors_total)
    for state in EmbedderState:
        m.embedder_state.labels(state.value).set(1 if services.embeddings.state is state else 0)
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
