"""POST /contribution: the gate before an agent contributes a trace; the /evaluate answer and
what the reference SDK's capture step would send, in one call (docs/contribution.md)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError

from app.api.deps import BEARER_SECURITY, services_of
from app.api.presenters import evaluation_out
from app.api.routes import evaluate
from app.api.routes.evaluate import DryRun, IdempotencyKey, _score, _sent_traces
from app.core.errors import field_error
from app.domain.contribution import FieldRisk, Gate, lone_surrogate, prepare
from app.schemas.contribution import ContributionOut, FieldRiskOut, FindingOut, InjectionOut
from app.schemas.trace import ReasoningTrace

_REFUSALS: dict[int | str, dict[str, Any]] = {
    **evaluate.router.responses,
    422: {
        "description": str(evaluate.router.responses[422]["description"])
        + " Also a string (or key) holding a lone surrogate: UTF-8 cannot carry it."
    },
}
router = APIRouter(tags=["contribution"], responses=_REFUSALS)

#: Past this body size the gate's text work runs off the event loop.
_INLINE_BODY_BYTES = 64 * 1024


@router.post(
    "/contribution",
    summary="Score a trace and show what contributing it would send",
    responses={200: {"description": "The score, and the trace as the SDK would contribute it."}},
    openapi_extra=BEARER_SECURITY,
)
async def contribution(
    trace: ReasoningTrace,
    request: Request,
    dry_run: DryRun = False,
    idempotency_key: IdempotencyKey = None,
) -> ContributionOut:
    services = services_of(request)
    sent = await _sent_traces(services, request, batch=False)
    given: dict[str, Any] = sent[0] if sent is not None else await request.json()
    where = lone_surrogate(given)
    if where is not None:
        msg = "holds a lone surrogate (a \\ud800-\\udfff escape without its pair): not UTF-8 text"
        raise RequestValidationError([field_error(("body", *where), msg, "lone_surrogate")])
    (evaluation,) = await _score(services, request, [trace], dry_run=dry_run, batch=False)
    settings = services.settings
    score = evaluation.score.value
    if len(await request.body()) <= _INLINE_BODY_BYTES:
        gate = prepare(given, quality_score=score, clean_all=settings.contribution_clean_all)
    else:
        gate = await asyncio.to_thread(
            prepare, given, quality_score=score, clean_all=settings.contribution_clean_all
        )
    signer = services.signer
    signature = (
        None
        if signer is None or sent is None
        else signer.sign(evaluation, sent[0], dry_run=dry_run, contribution=gate.contribution)
    )
    return _answer(
        gate,
        evaluation_out(evaluation, signature),
        threshold=settings.contribution_threshold,
    )


def _answer(gate: Gate, evaluation: Any, *, threshold: float) -> ContributionOut:
    return ContributionOut(
        evaluation=evaluation,
        shareable=evaluation.score >= threshold,
        threshold=threshold,
        contribution=gate.contribution,
        redactions=[FindingOut(path=f.path, type=f.type, count=f.count) for f in gate.redactions],
        uncleaned=[FindingOut(path=f.path, type=f.type, count=f.count) for f in gate.uncleaned],
        inputs_kept=list(gate.inputs_kept),
        injection=InjectionOut(
            fields=[_risk(f) for f in gate.injection],
            highest=None if gate.highest is None else _risk(gate.highest),
        ),
    )


def _risk(field: FieldRisk) -> FieldRiskOut:
    a = field.assessment
    return FieldRiskOut(
        path=field.path,
        score=a.score,
        max_score=a.max_score,
        patterns=list(a.patterns),
        verdict=a.verdict,
    )
