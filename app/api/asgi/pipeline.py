"""The request pipeline in the order a request meets it. Keys and limits come before the body
is read, so a refused request costs a header lookup; the body's limits before any parsing; the
idempotency record before the route parses and scores the trace."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI

from app.api.asgi.access_log import AccessLog
from app.api.asgi.api_keys import ApiKeys
from app.api.asgi.base import ASGIApp
from app.api.asgi.body_limits import BodySize, JsonDepth
from app.api.asgi.content_type import ContentType
from app.api.asgi.idempotency import IdempotencyKeys
from app.api.asgi.lingering_close import LingeringClose
from app.api.asgi.rate_limit import RateLimit
from app.api.asgi.request_id import RequestId
from app.core.api_keys import KeyRing
from app.core.metrics import Metrics


@dataclass(frozen=True, slots=True)
class Piece:
    cls: Any  # an ASGI middleware class: cls(app, **options)
    options: dict[str, Any]


def pieces(
    *,
    metrics: Metrics,
    keys: KeyRing,
    evaluate_open: bool,
    admin_open: bool,
    max_body_bytes: int,
    max_json_depth: int,
) -> list[Piece]:
    return [
        Piece(RequestId, {}),
        Piece(AccessLog, {"metrics": metrics}),
        Piece(LingeringClose, {}),
        Piece(
            ApiKeys,
            {
                "keys": keys,
                "evaluate_open": evaluate_open,
                "admin_open": admin_open,
                "metrics": metrics,
            },
        ),
        Piece(RateLimit, {"metrics": metrics}),
        Piece(ContentType, {}),
        Piece(BodySize, {"max_body_bytes": max_body_bytes}),
        Piece(JsonDepth, {"max_json_depth": max_json_depth}),
        Piece(IdempotencyKeys, {"metrics": metrics}),
    ]


def install(app: FastAPI, chain: list[Piece]) -> None:
    # Starlette runs the middleware added last first.
    for piece in reversed(chain):
        app.add_middleware(piece.cls, **piece.options)


def wrap(inner: ASGIApp, chain: list[Piece]) -> ASGIApp:
    """`inner` behind the pieces, outside FastAPI (for tests of the pipeline alone)."""
    for piece in reversed(chain):
        inner = piece.cls(inner, **piece.options)
    return inner
