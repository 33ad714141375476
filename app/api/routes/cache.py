"""/cache: what operators inspect, reset, export and import, each in the request's namespace
(KP-Namespace, or the admin key's; docs/api.md, namespaces), and the list of namespaces."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from app.api.deps import BearerDep, CallerDep, ServiceDep
from app.api.edge import caller_of
from app.schemas.responses import CacheOut, ClearedOut, ImportedOut, NamespacesOut

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

NDJSON = "application/x-ndjson"
_UNAVAILABLE: dict[int | str, dict[str, Any]] = {
    503: {
        "description": "The shared cache's Redis did not answer within KP_REDIS_TIMEOUT_MS: "
        "retry after Retry-After."
    }
}


@router.get("", summary="The namespace's cache: size, limits and counters")
async def cache_stats(service: ServiceDep, caller: CallerDep) -> CacheOut:
    return await service.cache_stats(caller)


@router.delete(
    "",
    summary="Empty the namespace's cache (shared: for every replica)",
    responses={
        200: {
            "description": "How many vectors were dropped.",
            "links": {"CacheStats": {"operationId": "cache_stats_cache_get"}},
        },
        **_UNAVAILABLE,
    },
)
async def cache_clear(service: ServiceDep, caller: CallerDep) -> ClearedOut:
    return await service.cache_clear(caller)


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
async def cache_export(service: ServiceDep, caller: CallerDep) -> StreamingResponse:
    return StreamingResponse(await service.cache_export(caller), media_type=NDJSON)


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
async def cache_import(request: Request, service: ServiceDep, caller: CallerDep) -> ImportedOut:
    content_type = request.headers.get("content-type")
    return await service.cache_import(caller, content_type, request.stream())


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
async def cache_namespaces(request: Request, service: ServiceDep) -> NamespacesOut:
    return await service.namespaces(caller_of(request.scope))
