"""GET and DELETE /cache: what operators inspect and reset."""

from __future__ import annotations

import logging
from dataclasses import asdict

from fastapi import APIRouter

from app.api.deps import AdminDep, Services, ServicesDep
from app.schemas.responses import CacheOut, ClearedOut, EmbedderOut

router = APIRouter(
    prefix="/cache",
    tags=["cache"],
    dependencies=[AdminDep],
    responses={
        401: {"description": "KP_ADMIN_TOKEN is set and the bearer token is missing or wrong."}
    },
)
log = logging.getLogger(__name__)


def embedder_out(services: Services) -> EmbedderOut:
    e = services.embeddings
    return EmbedderOut(
        state=e.state,
        model=e.model_name,
        precision=e.precision,
        precision_reason=e.precision_reason,
        reason=e.reason,
    )


@router.get("", summary="Cache size, limits and counters")
async def cache_stats(services: ServicesDep) -> CacheOut:
    return CacheOut(**asdict(services.cache.stats()), embedder=embedder_out(services))


@router.delete(
    "",
    summary="Empty the cache",
    responses={
        200: {
            "description": "How many vectors were dropped.",
            "links": {"CacheStats": {"operationId": "cache_stats_cache_get"}},
        }
    },
)
async def cache_clear(services: ServicesDep) -> ClearedOut:
    cleared = services.cache.clear()
    log.info("cache cleared", extra={"cleared": cleared})
    return ClearedOut(cleared=cleared)
