"""FastAPI dependencies: the service objects of the running app, and the bearer scheme."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Header, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.api.asgi.namespaces import namespace_of
from app.core import namespaces
from app.core.config import Settings
from app.core.metrics import Metrics
from app.embedding.embeddings import EmbeddingService
from app.guards.idempotency_keys import Idempotency
from app.guards.rate_limit import RateLimiter
from app.memory.base import NoveltyMemory
from app.schemas.limits import TraceLimits
from app.service.evaluator import Evaluator
from app.service.runtime import Runtime

if TYPE_CHECKING:
    from app.service.signing import Signer


@dataclass(slots=True)
class Services:
    """Everything a request may need, built once per app in the lifespan."""

    settings: Settings
    runtime: Runtime
    metrics: Metrics
    limits: TraceLimits
    signer: Signer | None

    @property
    def memory(self) -> NoveltyMemory:
        return self.runtime.memory

    @property
    def embeddings(self) -> EmbeddingService:
        return self.runtime.embeddings

    @property
    def evaluator(self) -> Evaluator:
        return self.runtime.evaluator

    @property
    def rate_limiter(self) -> RateLimiter:
        return self.runtime.trust.rate_limiter

    @property
    def idempotency(self) -> Idempotency:
        return self.runtime.trust.idempotency


def services_of(request: Request) -> Services:
    """The running app's services; what `ServicesDep` resolves to."""
    services: Services = request.app.state.services
    return services


# Dependencies are `async def`: FastAPI runs a plain `def` dependency on its thread pool, a
# thread hop per request for what is an attribute lookup.
async def get_services(request: Request) -> Services:
    return services_of(request)


ServicesDep = Annotated[Services, Depends(get_services)]

_bearer = HTTPBearer(
    auto_error=False,
    description="An API key of KP_API_KEYS_FILE with the route's scope (evaluate, admin), or "
    "KP_ADMIN_TOKEN for /cache. Checked before the body is read (app/api/asgi/api_keys.py).",
)


async def bearer_documented(
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """Declares the bearer scheme in the OpenAPI document; the ApiKeys piece of the request
    pipeline checks the key, before a body is read."""


BearerDep = Depends(bearer_documented)

#: The same scheme, declared without a dependency for the hot scoring routes: each dependency
#: costs FastAPI a resolution per request (`bearer_documented` two), and this one does nothing
#: at run time. The OpenAPI document is the same (tests/test_openapi.py).
BEARER_SECURITY: dict[str, list[dict[str, list[str]]]] = {"security": [{_bearer.scheme_name: []}]}

#: The `KP-Namespace` header, declared for the document (and the routes' parameters). The
#: Namespaces piece of the request pipeline reads and checks it, before the body is read
#: (app/api/asgi/namespaces.py); a route reads the result with `namespace_of`.
NamespaceHeader = Annotated[
    str | None,
    Header(
        alias=namespaces.HEADER,
        pattern=namespaces.PATTERN,
        description="The namespace (the memory) the request acts on: 1 to 64 letters, digits, "
        "'.', '_' or '-' (422 otherwise). Without it: the API key's bound namespace, else "
        f"`{namespaces.DEFAULT}`. A key bound to a namespace may name no other (403).",
    ),
]


async def request_namespace(request: Request, kp_namespace: NamespaceHeader = None) -> str:
    """The request's namespace, as the pipeline resolved it from the header and the key."""
    return namespace_of(request.scope)


NamespaceDep = Annotated[str, Depends(request_namespace)]
