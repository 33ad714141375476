"""GET and DELETE /cache: what operators inspect and reset."""

from __future__ import annotations

import logging
from dataclasses import asdict

from fastapi import APIRouter

from app.api.deps import BearerDep, Services, ServicesDep
from app.api.presenters import backend_out
from app.schemas.responses import CacheOut, ClearedOut, EmbedderOut

router = APIRouter(
    prefix="/cache",
    tags=["cache"],
    dependencies=[BearerDep],
    responses={
        400: {"description": "A key in the query string instead of the Authorization header."},
        401: {
            "description": "KP_API_KEYS_FILE or KP_ADMIN_TOKEN is set and the bearer key is "
            "missing or unknown."
        },
        403: {"description": "The key lacks the scope admin."},
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
    stats = await services.memory.stats()
    return CacheOut(
        **asdict(stats),
        embedder=embedder_out(services),
        backend=backend_out(services.memory.backend),
    )


@router.delete(
    "",
    summary="Empty the cache (shared: for every replica)",
    responses={
        200: {
            "description": "How many vectors were dropped.",
            "links": {"CacheStats": {"operationId": "cache_stats_cache_get"}},
        },
        503: {
            "description": "The shared cache's Redis did not answer within "
            "KP_REDIS_TIMEOUT_MS: retry after Retry-After."
        },
    },
)
async def cache_clear(services: ServicesDep) -> ClearedOut:
    cleared = await services.memory.clear()  # MemoryUnavailableError: 503 (app.api.errors)
    log.info("cache cleared", extra={"cleared": cleared})
    return ClearedOut(cleared=cleared)
