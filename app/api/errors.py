"""Errors as REST answers, in one place: a ServiceError, FastAPI's own errors and anything
unexpected (500, logged, no internals shown) all leave through `error_response`.

Rendering never fails: a location or a message may carry what the client sent (a key holding a
lone surrogate, a megabyte-long key), so every string is cut to a bound and every character
UTF-8 cannot carry is written as its escape.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from app.core.errors import ServiceError, invalid, problems_of

log = logging.getLogger(__name__)

#: The longest string (a location's key, a message) an error answer repeats, in characters.
MAX_SHOWN_CHARS = 256

#: What a request with no body hears, rather than pydantic's "Field required" at `body`:
#: `curl -d @file` sends an empty body when the file is not found.
EMPTY_BODY = (
    "the request body is empty: send the JSON document (with curl, -d @FILE sends nothing "
    "when FILE is not found from the current directory)"
)


def shortened(text: str) -> str:
    """`text` cut to MAX_SHOWN_CHARS characters: a key in a location can be as long as a body."""
    return text if len(text) <= MAX_SHOWN_CHARS else text[: MAX_SHOWN_CHARS - 1] + "…"


def shown(text: str) -> str:
    """`text` as a JSON answer may repeat it: shortened, and what UTF-8 cannot carry (a lone
    surrogate) as its backslash escape."""
    text = shortened(text)
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _shown_value(part: Any) -> str | int:
    """An index as a number (within what every JSON reader holds exactly), anything else as
    shown text."""
    if isinstance(part, int) and not isinstance(part, bool) and abs(part) <= 2**53:
        return part
    return shown(str(part))


def error_body(error: ServiceError) -> bytes:
    if error.problems is None:
        return orjson.dumps({"detail": shown(error.message)})
    entries = [
        {
            **{shown(str(k)): _shown_value(v) for k, v in p.extra.items()},
            "loc": [_shown_value(part) for part in p.loc],
            "msg": shown(p.msg),
            "type": shown(p.type),
        }
        for p in error.problems
    ]
    return orjson.dumps({"detail": entries})


def error_response(error: ServiceError) -> Response:
    headers = dict(error.headers)
    if error.retry_after is not None:
        headers["Retry-After"] = str(error.retry_after)
    return Response(error_body(error), error.status, headers=headers, media_type="application/json")


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = [
        {**e, "msg": EMPTY_BODY, "type": "body_empty"}
        if tuple(e["loc"]) == ("body",) and e["type"] == "missing"
        else e
        for e in exc.errors()
    ]
    return error_response(invalid(problems_of(errors)))


async def _http_error(request: Request, exc: Exception) -> Response:
    """FastAPI's own errors in the same shape; a 405's Allow lists every method the document
    gives the path (each route knows only its own: GET /cache would say `Allow: GET`)."""
    assert isinstance(exc, HTTPException)
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        documented = request.app.openapi()["paths"].get(request.url.path)
        if documented:  # the paths have no templates: the request's path is the key
            headers["Allow"] = ", ".join(sorted(method.upper() for method in documented))
    if exc.status_code in (204, 304):
        return Response(status_code=exc.status_code, headers=headers)
    error = ServiceError(exc.status_code, "http", str(exc.detail), headers=headers)
    return error_response(error)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error", extra={"path": request.url.path})
    return error_response(ServiceError(500, "internal", "internal error"))


def install_error_handlers(app: FastAPI) -> None:
    """FastAPI's own errors and the unexpected; a ServiceError is Edge's to answer
    (app/api/edge.py), from the middleware as from the routes."""
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
