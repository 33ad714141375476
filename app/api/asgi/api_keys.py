"""API keys and scopes, checked before the body is read: 401 (with WWW-Authenticate) without a
key or with an unknown one, 403 for a key without the route's scope, 400 for a key put in the
query string (URLs end up in logs and proxies' histories)."""

from __future__ import annotations

from urllib.parse import unquote_plus

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from app.api.asgi.base import detail, send_json, state
from app.core.metrics import Metrics
from app.guards.api_keys import KeyRing
from app.guards.api_keys import Scope as KeyScope

_CHALLENGE = (b"www-authenticate", b'Bearer realm="kp-scoring"')
#: Query parameters in which clients commonly put keys, as _spelling() writes them: any case,
#: any separators, percent-encoded or not (api_key, API-KEY, apiKey, api%5Fkey are one).
_KEY_PARAMS = frozenset(
    {
        "apikey",
        "key",
        "token",
        "accesstoken",
        "authtoken",
        "apitoken",
        "bearer",
        "authorization",
        "xapikey",
    }
)


def required_scope(path: str) -> KeyScope | None:
    if path in ("/evaluate", "/evaluate/batch", "/contribution", "/mcp"):  # /mcp: scoring tools
        return "evaluate"
    if path == "/cache" or path.startswith("/cache/"):
        return "admin"
    return None


class ApiKeys:
    """`keys`: the keys file's keys and KP_ADMIN_TOKEN. An open route (`evaluate_open`: no keys
    file; `admin_open`: no keys file and no admin token) serves every caller as before; a key
    it knows still names the caller (for idempotency and logs)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: KeyRing,
        evaluate_open: bool,
        admin_open: bool,
        metrics: Metrics,
    ) -> None:
        self.app = app
        self.keys = keys
        self.evaluate_open = evaluate_open
        self.admin_open = admin_open
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        needed = required_scope(scope["path"])
        if needed is None:
            await self.app(scope, receive, send)
            return
        in_query = _key_in_query(scope)
        if in_query is not None:
            msg = "API keys go in the Authorization header (Bearer), never in the URL"
            await send_json(send, 400, detail(("query", in_query), msg, "key_in_query"))
            return
        given = sum(1 for name, _ in scope["headers"] if name == b"authorization")
        if given > 1:
            # Which one a proxy, a log or this service reads first is anyone's guess.
            msg = f"one Authorization header, not {given}"
            await send_json(send, 400, detail(("header", "authorization"), msg, "repeated_header"))
            return
        presented = _bearer(Headers(scope=scope).get("authorization"))
        key = None if presented is None else self.keys.identify(presented)
        if self.evaluate_open if needed == "evaluate" else self.admin_open:
            if key is not None and needed in key.scopes:
                state(scope)["api_key"] = key
            await self.app(scope, receive, send)
            return
        if key is None:
            what = "an API key" if needed == "evaluate" else "KP_ADMIN_TOKEN or an admin key"
            problem = "is required" if presented is None else "is not valid"
            await self._refuse(
                send,
                401,
                "missing" if presented is None else "unknown_key",
                f"a bearer key {problem}: Authorization: Bearer <{what}>",
            )
            return
        if needed not in key.scopes:
            await self._refuse(
                send, 403, "missing_scope", f"the API key {key.name!r} lacks the scope {needed!r}"
            )
            return
        state(scope)["api_key"] = key
        await self.app(scope, receive, send)

    async def _refuse(self, send: Send, status: int, reason: str, msg: str) -> None:
        self.metrics.child(self.metrics.auth_refused, reason).inc()
        headers = [_CHALLENGE] if status == 401 else []
        kind = "forbidden" if status == 403 else "unauthorized"
        await send_json(send, status, detail(("header", "authorization"), msg, kind), headers)


def _bearer(value: str | None) -> str | None:
    if value is None:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _key_in_query(scope: Scope) -> str | None:
    query: bytes = scope.get("query_string", b"")
    if not query:
        return None
    for pair in query.decode("latin-1").replace(";", "&").split("&"):
        name = unquote_plus(pair.partition("=")[0], encoding="latin-1")
        if _spelling(name) in _KEY_PARAMS:
            return name
    return None


def _spelling(name: str) -> str:
    """The parameter's name without case, separators or anything else but letters and
    digits: every way of writing api_key is `apikey`."""
    return "".join(c for c in name.casefold() if c.isalnum())
