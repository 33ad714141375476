"""Error answers: every client mistake is a 4xx naming the field, no error shows internals.

Typed errors the services raise map to a status in one table; the 503s (the service may
answer after a short wait) carry Retry-After.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from app.core import namespaces
from app.core.errors import error_body, field_error
from app.embedding.embeddings import OverloadedError
from app.memory.base import MemoryUnavailableError, NamespaceLimitError

log = logging.getLogger(__name__)

#: Seconds a client waits before it retries a 503.
RETRY_AFTER_S = 1


@dataclass(frozen=True, slots=True)
class ErrorKind:
    status: int
    #: Said before the error's own text.
    prefix: str = ""


ERRORS: dict[type[Exception], ErrorKind] = {
    OverloadedError: ErrorKind(503, "overloaded, try again shortly: "),
    MemoryUnavailableError: ErrorKind(503),
}


def error_response(status: int, detail: str) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return JSONResponse(status_code=status, content={"detail": detail}, headers=headers)


#: What a request with no body hears, rather than pydantic's "Field required" at `body`:
#: `curl -d @file` sends an empty body when the file is not found.
EMPTY_BODY = (
    "the request body is empty: send the JSON document (with curl, -d @FILE sends nothing "
    "when FILE is not found from the current directory)"
)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = [
        {**e, "msg": EMPTY_BODY, "type": "body_empty"}
        if tuple(e["loc"]) == ("body",) and e["type"] == "missing"
        else e
        for e in exc.errors()
    ]
    return JSONResponse(status_code=422, content=error_body(errors))


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's answer, but a 405's Allow lists every method the document gives the path:
    each route knows only its own (GET /cache would say `Allow: GET`, though DELETE exists)."""
    assert isinstance(exc, HTTPException)
    documented = (
        request.app.openapi()["paths"].get(request.url.path) if exc.status_code == 405 else None
    )
    if documented:  # the paths have no templates: the request's path is the key
        allowed = ", ".join(sorted(method.upper() for method in documented))
        exc = HTTPException(405, exc.detail, headers={**(exc.headers or {}), "Allow": allowed})
    response = await http_exception_handler(request, exc)
    assert isinstance(response, JSONResponse)
    return response


async def _typed_error(request: Request, exc: Exception) -> JSONResponse:
    # An overload is counted where it is raised (services/scoring_requests.py).
    kind = ERRORS[type(exc)]
    return error_response(kind.status, f"{kind.prefix}{exc}")


async def _namespace_limit(request: Request, exc: Exception) -> JSONResponse:
    """409 in the shape of a request's errors, pointing at the header that named the namespace:
    not transient (no Retry-After), it holds until a namespace is cleared."""
    request.app.state.services.metrics.namespace_limit.inc()
    body = error_body([field_error(namespaces.LOC, str(exc), "namespace_limit")])
    return JSONResponse(status_code=409, content=body)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", extra={"path": request.url.path})
    return JSONResponse(status_code=500, content={"detail": "internal error"})


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    for error in ERRORS:
        app.add_exception_handler(error, _typed_error)
    app.add_exception_handler(NamespaceLimitError, _namespace_limit)
    app.add_exception_handler(Exception, _unexpected)
