"""Error answers: every client mistake is a 4xx naming the field, no error shows internals."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from app.services.embeddings import OverloadedError

log = logging.getLogger(__name__)


def _clean(error: dict[str, Any]) -> dict[str, Any]:
    # pydantic also echoes the offending input; a trace's text does not belong in error bodies.
    return {"loc": list(error["loc"]), "msg": error["msg"], "type": error["type"]}


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return JSONResponse(status_code=422, content={"detail": [_clean(e) for e in exc.errors()]})


async def _overloaded(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OverloadedError)  # counted where it is raised (score_traces)
    return JSONResponse(
        status_code=503,
        content={"detail": f"overloaded, try again shortly: {exc}"},
        headers={"Retry-After": "1"},
    )


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", extra={"path": request.url.path})
    return JSONResponse(status_code=500, content={"detail": "internal error"})


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(OverloadedError, _overloaded)
    app.add_exception_handler(Exception, _unexpected)
