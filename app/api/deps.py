"""FastAPI dependencies and parameters the routes share: the service, the caller Admission
settled, and the headers the OpenAPI document declares (Admission checks them first)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.api.edge import caller_of
from app.core import namespaces
from app.service.scoring_service import Caller, ScoringService

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


# Dependencies are `async def`: FastAPI runs a plain `def` dependency on its thread pool, a
# thread hop per request for what is an attribute lookup.
async def get_service(request: Request) -> ScoringService:
    service: ScoringService = request.app.state.service
    return service


async def get_caller(request: Request, kp_namespace: NamespaceHeader = None) -> Caller:
    """The caller Admission settled (it read the header, declared here for the document)."""
    return caller_of(request.scope)


ServiceDep = Annotated[ScoringService, Depends(get_service)]
CallerDep = Annotated[Caller, Depends(get_caller)]

_bearer = HTTPBearer(
    auto_error=False,
    description="An API key of KP_API_KEYS_FILE with the route's scope (evaluate, admin), or "
    "KP_ADMIN_TOKEN for /cache. Checked before the body is read.",
)


async def bearer_documented(
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """Declares the bearer scheme in the OpenAPI document; Admission checks the key."""


BearerDep = Depends(bearer_documented)

#: The same scheme, declared without a dependency for the scoring routes: each dependency
#: costs FastAPI a resolution per request, and this one does nothing at run time.
BEARER_SECURITY: dict[str, list[dict[str, list[str]]]] = {"security": [{_bearer.scheme_name: []}]}


DryRun = Annotated[
    bool, Query(description="Score without adding the trace's embedding to the cache.")
]

IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        # The service checks it (400 otherwise); its rule is stated in the document
        # (app/api/openapi_doc.py).
        description="The same key with the same request within 24 h gets the first answer "
        "again, byte for byte (header Idempotent-Replayed: true), and adds nothing; with "
        "another request, 422. Scoped to the API key and the namespace.",
    ),
]
