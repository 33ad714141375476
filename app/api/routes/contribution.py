"""POST /contribution: the gate before an agent contributes a trace; the /evaluate answer and
what the reference SDK's capture step would send, in one call (docs/contribution.md)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError

from app.api.deps import BEARER_SECURITY, NamespaceHeader, Services, services_of
from app.api.presenters import evaluation_out
from app.api.routes import evaluate
from app.api.routes.evaluate import DryRun, IdempotencyKey, _score, _sent_traces
from app.contribution.capture import FieldRisk, Finding, lone_surrogate, prepare
from app.core.errors import field_error
from app.core.signatures import trace_sha256
from app.schemas.contribution import ContributionOut, FieldRiskOut, FindingOut, InjectionOut
from app.schemas.responses import rounded
from app.schemas.trace import ReasoningTrace
from app.service.evaluator import Evaluation

_REFUSALS: dict[int | str, dict[str, Any]] = {
    **evaluate.router.responses,
    422: {
        "description": str(evaluate.router.responses[422]["description"])
        + " Also a string (or key) holding a lone surrogate: UTF-8 cannot carry it."
    },
}
router = APIRouter(tags=["contribution"], responses=_REFUSALS)

#: Past this body size the gate's text work runs off the event loop.
INLINE_BODY_BYTES = 64 * 1024


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
    kp_namespace: NamespaceHeader = None,
) -> ContributionOut:
    services = services_of(request)
    sent = await _sent_traces(services, request, batch=False)
    given: dict[str, Any] = sent[0] if sent is not None else await request.json()
    errors = lone_surrogate_errors(given, ("body",))
    if errors:
        raise RequestValidationError(errors)
    (evaluation,) = await _score(services, request, [trace], dry_run=dry_run, batch=False)
    large = len(await request.body()) > INLINE_BODY_BYTES
    return await contribution_answer(
        services, evaluation, given, signed=sent is not None, dry_run=dry_run, large=large
    )


def lone_surrogate_errors(given: Any, at: tuple[str, ...]) -> list[dict[str, Any]]:
    """A trace the SDK takes but UTF-8 cannot carry: an error naming where, or none."""
    where = lone_surrogate(given)
    if where is None:
        return []
    msg = "holds a lone surrogate (a \\ud800-\\udfff escape without its pair): not UTF-8 text"
    return [field_error((*at, *where), msg, "lone_surrogate")]


async def contribution_answer(
    services: Services,
    evaluation: Evaluation,
    given: dict[str, Any],
    *,
    signed: bool,
    dry_run: bool,
    large: bool,
) -> ContributionOut:
    """The answer for a scored trace; `given`: the trace as the agent sent it (parsed JSON);
    `signed`: `given` passed the signing check (unsignable_errors); `large`: the text work
    runs off the event loop."""
    settings = services.settings
    score = rounded(evaluation.score.value)  # as the answer shows it
    clean_all = settings.contribution_clean_all
    gate = (
        await asyncio.to_thread(prepare, given, quality_score=score, clean_all=clean_all)
        if large
        else prepare(given, quality_score=score, clean_all=clean_all)
    )
    # The cleaned trace's digest is signed beside the trace's: a registry sent the contribution
    # can tell it is the one scored and cleaned here.
    signer = services.signer if signed else None
    claims = None if signer is None else {"contribution_sha256": trace_sha256(gate.contribution)}
    threshold = settings.contribution_threshold
    return ContributionOut(
        evaluation=evaluation_out(evaluation, signer, given, dry_run=dry_run, claims=claims),
        shareable=score >= threshold,
        threshold=threshold,
        contribution=gate.contribution,
        redactions=[_finding(f) for f in gate.redactions],
        uncleaned=[_finding(f) for f in gate.uncleaned],
        inputs_kept=list(gate.inputs_kept),
        injection=InjectionOut(
            fields=[_risk(f) for f in gate.injection],
            highest=None if gate.highest is None else _risk(gate.highest),
        ),
    )


def _finding(finding: Finding) -> FindingOut:
    return FindingOut.model_validate(finding, from_attributes=True)


def _risk(field: FieldRisk) -> FieldRiskOut:
    a = field.assessment
    return FieldRiskOut(
        path=field.path,
        score=a.score,
        max_score=a.max_score,
        patterns=list(a.patterns),
        verdict=a.verdict,
    )
