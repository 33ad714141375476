"""GET /.well-known/jwks.json: the public keys that verify signed scores."""

from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import ServicesDep
from app.schemas.responses import JwksOut

router = APIRouter(tags=["signatures"])


@router.get("/.well-known/jwks.json", summary="Public keys of signed scores (JWKS)")
async def jwks(services: ServicesDep) -> JwksOut:
    signer = services.signer
    return JwksOut.model_validate(signer.jwks() if signer is not None else {"keys": []})
