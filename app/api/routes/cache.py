"""/cache: what operators inspect, reset, export and import."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.responses import StreamingResponse

from app.api.deps import BearerDep, Services, ServicesDep
from app.api.presenters import backend_out
from app.schemas.responses import CacheOut, ClearedOut, EmbedderOut, ImportedOut
from app.services.cache_transfer import (
    BodyTooLargeError,
    ImportLineError,
    export_lines,
    read_body,
)
from app.store.base import DEFAULT_NAMESPACE

router = APIRouter(
    prefix="/cache",
    tags=["cache"],
    dependencies=[BearerDep],
    responses={
        400: {
            "description": "A key in the query string (any spelling of api_key, token...) "
            "instead of the Authorization header, or two Authorization headers."
        },
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
    stats = await services.memory.stats(DEFAULT_NAMESPACE)
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
    cleared = await services.memory.clear(
        DEFAULT_NAMESPACE
    )  # MemoryUnavailableError: 503 (app.api.errors)
    log.info("cache cleared", extra={"cleared": cleared})
    return ClearedOut(cleared=cleared)


NDJSON = "application/x-ndjson"
_UNAVAILABLE: dict[int | str, dict[str, Any]] = {
    503: {
        "description": "The shared cache's Redis did not answer within KP_REDIS_TIMEOUT_MS: "
        "retry after Retry-After."
    }
}


@router.get(
    "/export",
    summary="Every cached entry, oldest first, as NDJSON",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": 'One entry a line: {"trace_id", "added_at_ms", "vector": base64 of '
            "the little-endian float32 values}; streamed, oldest first.",
            "content": {NDJSON: {"schema": {"type": "string"}}},
        },
        **_UNAVAILABLE,
    },
)
async def cache_export(services: ServicesDep) -> StreamingResponse:
    chunks = services.memory.export_chunks(DEFAULT_NAMESPACE)
    # The first chunk before the answer starts: an unreachable Redis is a 503 (MemoryUnavailable
    # Error, app.api.errors), not a truncated 200.
    first = await anext(chunks, None)

    async def lines() -> AsyncIterator[bytes]:
        if first is None:
            return
        for line in export_lines([first]):
            yield line
        async for chunk in chunks:
            for line in export_lines([chunk]):
                yield line

    return StreamingResponse(lines(), media_type=NDJSON)


@router.post(
    "/import",
    summary="Append NDJSON entries (as exported) as the newest, all or nothing",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {NDJSON: {"schema": {"type": "string"}}},
            "description": "The lines of GET /cache/export; any number, up to "
            "KP_CACHE_IMPORT_MAX_BYTES a request.",
        }
    },
    responses={
        413: {"description": "Larger than KP_CACHE_IMPORT_MAX_BYTES; nothing was imported."},
        415: {"description": "Content-Type is not application/x-ndjson."},
        422: {"description": "A bad line, named by its number; nothing was imported."},
        **_UNAVAILABLE,
    },
)
async def cache_import(request: Request, services: ServicesDep) -> ImportedOut:
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type not in (NDJSON, "application/jsonl"):
        raise HTTPException(
            status_code=status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
            detail=[
                {
                    "loc": ["header", "content-type"],
                    "msg": f"must be {NDJSON}, got {content_type or 'none'!r}",
                    "type": "unsupported_media_type",
                }
            ],
        )
    try:
        entries, lines = await read_body(
            request.stream(), services.memory.dimensions, services.settings.cache_import_max_bytes
        )
    except BodyTooLargeError as exc:
        raise HTTPException(
            status_code=status.HTTP_413_CONTENT_TOO_LARGE,
            detail=[{"loc": ["body"], "msg": str(exc), "type": "body_too_large"}],
        ) from None
    except ImportLineError as exc:
        raise HTTPException(
            status_code=status.HTTP_422_UNPROCESSABLE_CONTENT,
            detail=[
                {"loc": ["body", exc.line], "msg": str(exc), "type": "bad_line", "line": exc.line}
            ],
        ) from None
    imported, expired = await services.memory.import_entries(
        DEFAULT_NAMESPACE, entries
    )  # 503: app.api.errors
    log.info("cache imported", extra={"imported": imported, "expired": expired})
    return ImportedOut(imported=imported, expired=expired, lines=lines)
