"""/cache: what operators inspect, reset, export and import, each in the request's namespace
(KP-Namespace, or the admin key's; docs/api.md, namespaces), and the list of namespaces."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.responses import StreamingResponse

from app.api.deps import BearerDep, NamespaceDep, Services, ServicesDep
from app.api.presenters import backend_out
from app.guards.api_keys import ApiKey
from app.schemas.namespaces import NamespacesOut
from app.schemas.responses import CacheOut, ClearedOut, EmbedderOut, ImportedOut
from app.service.cache_transfer import (
    BodyTooLargeError,
    ImportLineError,
    export_lines,
    read_body,
)

router = APIRouter(
    prefix="/cache",
    tags=["cache"],
    dependencies=[BearerDep],
    responses={
        400: {
            "description": "A key in the query string (any spelling of api_key, token...) "
            "instead of the Authorization header, two Authorization headers, or two "
            "KP-Namespace headers."
        },
        401: {
            "description": "KP_API_KEYS_FILE or KP_ADMIN_TOKEN is set and the bearer key is "
            "missing or unknown."
        },
        403: {
            "description": "The key lacks the scope admin, or is bound to another namespace "
            "than KP-Namespace names (namespace_forbidden)."
        },
        422: {"description": "A KP-Namespace that breaks the name's rule (namespace_invalid)."},
    },
)
log = logging.getLogger(__name__)


def embedder_out(services: Services) -> EmbedderOut:
    e = services.embeddings
    return EmbedderOut(
        state=e.state,
        model=e.model_name,
        weights=e.weights,
        precision=e.precision,
        precision_reason=e.precision_reason,
        reason=e.reason,
    )


@router.get("", summary="The namespace's cache: size, limits and counters")
async def cache_stats(services: ServicesDep, namespace: NamespaceDep) -> CacheOut:
    stats = await services.memory.stats(namespace)
    return CacheOut(
        namespace=namespace,
        **asdict(stats),
        embedder=embedder_out(services),
        backend=backend_out(services.memory.backend),
    )


@router.delete(
    "",
    summary="Empty the namespace's cache (shared: for every replica)",
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
async def cache_clear(services: ServicesDep, namespace: NamespaceDep) -> ClearedOut:
    cleared = await services.memory.clear(namespace)  # MemoryUnavailable: 503 (app.api.errors)
    log.info("cache cleared", extra={"cleared": cleared, "namespace": namespace})
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
    summary="Every entry of the namespace's cache, oldest first, as NDJSON",
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
async def cache_export(services: ServicesDep, namespace: NamespaceDep) -> StreamingResponse:
    chunks = services.memory.export_chunks(namespace)
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
    summary="Append NDJSON entries (as exported) as the namespace's newest, all or nothing",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {NDJSON: {"schema": {"type": "string"}}},
            "description": "The lines of GET /cache/export; any number, up to "
            "KP_CACHE_IMPORT_MAX_BYTES a request.",
        }
    },
    responses={
        409: {
            "description": "The import would start a namespace past KP_MAX_NAMESPACES "
            "(namespace_limit); nothing was imported."
        },
        413: {"description": "Larger than KP_CACHE_IMPORT_MAX_BYTES; nothing was imported."},
        415: {"description": "Content-Type is not application/x-ndjson."},
        422: {"description": "A bad line, named by its number; nothing was imported."},
        **_UNAVAILABLE,
    },
)
async def cache_import(
    request: Request, services: ServicesDep, namespace: NamespaceDep
) -> ImportedOut:
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
    # 503 and 409 (NamespaceLimitError): app.api.errors
    imported, expired = await services.memory.import_entries(namespace, entries)
    log.info(
        "cache imported", extra={"imported": imported, "expired": expired, "namespace": namespace}
    )
    return ImportedOut(imported=imported, expired=expired, lines=lines)


@router.get(
    "/namespaces",
    summary="The namespaces that hold entries",
    responses={
        403: {
            "description": "The key lacks the scope admin, or is bound to a namespace: the "
            "list names every tenant (namespace_forbidden)."
        },
        **_UNAVAILABLE,
    },
)
async def cache_namespaces(request: Request, services: ServicesDep) -> NamespacesOut:
    key: ApiKey | None = getattr(request.state, "api_key", None)
    if key is not None and key.namespace is not None:
        services.metrics.child(services.metrics.auth_refused, "namespace_forbidden").inc()
        msg = (
            f"the API key {key.name!r} is bound to the namespace {key.namespace!r}: listing "
            "every namespace needs KP_ADMIN_TOKEN or an admin key bound to none"
        )
        raise HTTPException(
            status_code=status.HTTP_403_FORBIDDEN,
            detail=[
                {"loc": ["header", "authorization"], "msg": msg, "type": "namespace_forbidden"}
            ],
        )
    return NamespacesOut(
        namespaces=await services.memory.namespaces(), limit=services.settings.max_namespaces
    )
