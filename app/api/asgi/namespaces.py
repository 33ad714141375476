"""The request's namespace, before the body is read (docs/api.md, namespaces): the
`KP-Namespace` header, else the API key's bound namespace, else `default`. A bad name is a 422
and a bound key naming another namespace a 403, both before anything is read or changed. The
namespace is left in the request's state for the idempotency record, the routes and MCP."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from app.api.asgi.api_keys import required_scope
from app.api.asgi.base import detail, send_json, state
from app.core import namespaces
from app.core.metrics import Metrics
from app.guards.api_keys import ApiKey

_HEADER = namespaces.HEADER.lower().encode()


class Namespaces:
    def __init__(self, app: ASGIApp, *, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or required_scope(scope["path"]) is None:
            await self.app(scope, receive, send)
            return
        given = sum(1 for name, _ in scope["headers"] if name == _HEADER)
        if given > 1:
            msg = f"one {namespaces.HEADER} header, not {given}"
            await send_json(send, 400, detail(namespaces.LOC, msg, "repeated_header"))
            return
        key: ApiKey | None = state(scope).get("api_key")
        try:
            namespace = namespaces.resolve(
                Headers(scope=scope).get(namespaces.HEADER),
                key_name=None if key is None else key.name,
                bound=None if key is None else key.namespace,
            )
        except namespaces.NamespaceRefusedError as exc:
            if exc.status == 403:
                self.metrics.child(self.metrics.auth_refused, exc.kind).inc()
            await send_json(send, exc.status, detail(namespaces.LOC, str(exc), exc.kind))
            return
        state(scope)["namespace"] = namespace
        await self.app(scope, receive, send)


def namespace_of(scope: Scope) -> str:
    """The namespace the pipeline resolved for this request (`default` outside it)."""
    found: str = scope.get("state", {}).get("namespace", namespaces.DEFAULT)
    return found
