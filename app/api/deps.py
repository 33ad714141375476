"""FastAPI dependencies: the service objects of the running app, and the admin check."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.core.config import Settings
from app.core.metrics import Metrics
from app.schemas.limits import TraceLimits
from app.services.embeddings import EmbeddingService
from app.services.evaluator import Evaluator
from app.services.runtime import Runtime
from app.services.snapshots import SnapshotStore
from app.store.base import NoveltyMemory


@dataclass(slots=True)
class Services:
    """Everything a request may need, built once per app in the lifespan."""

    settings: Settings
    runtime: Runtime
    metrics: Metrics
    limits: TraceLimits

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
    def snapshots(self) -> SnapshotStore:
        return self.runtime.snapshots


# Dependencies are `async def`: FastAPI runs a plain `def` dependency on its thread pool, a
# thread hop per request for what is an attribute lookup.
async def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]

_bearer = HTTPBearer(auto_error=False, description="KP_ADMIN_TOKEN, when the operator set one.")


async def require_admin(
    services: ServicesDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """Open when KP_ADMIN_TOKEN is unset; otherwise the bearer token must match it."""
    token = services.settings.admin_token
    if token is None:
        return
    given = credentials.credentials if credentials is not None else ""
    if credentials is None or not secrets.compare_digest(
        given.encode(), token.get_secret_value().encode()
    ):
        raise HTTPException(
            status_code=status.HTTP_401_UNAUTHORIZED,
            detail="a valid admin token is required: Authorization: Bearer <KP_ADMIN_TOKEN>",
            headers={"WWW-Authenticate": 'Bearer realm="kp-scoring"'},
        )


AdminDep = Depends(require_admin)
