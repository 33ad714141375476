"""POST /contribution: the gate before an agent contributes a trace; the /evaluate answer and
what the reference SDK's capture step would send, in one call (docs/contribution.md)."""

from __future__ import annotations

import asyncio
import functools
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.exceptions import RequestValidationError

from app.api.deps import BEARER_SECURITY, NamespaceHeader, Services, services_of
from app.api.presenters import evaluation_out
from app.api.routes import evaluate
from app.api.routes.evaluate import DryRun, IdempotencyKey, _score, _sent_traces
from app.contribution.capture import FieldRisk, Finding, lone_surrogate, prepare
from app.core.errors import field_error
from app.core.signatures import contribution_claims
from app.schemas.contribution import (
    REDACT_SUSPECTED,
    REJECT_THRESHOLD,
    SUSPICIOUS_THRESHOLD,
    ContributionOptions,
    ContributionOut,
    FieldRiskOut,
    FindingOut,
    GateOptions,
    InjectionOut,
)
from app.schemas.limits import sent_string_errors
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
    redact_suspected: Annotated[bool | None, Query(description=REDACT_SUSPECTED)] = None,
    suspicious_threshold: Annotated[
        float | None, Query(ge=0, le=1, description=SUSPICIOUS_THRESHOLD)
    ] = None,
    reject_threshold: Annotated[
        float | None, Query(ge=0, le=1, description=REJECT_THRESHOLD)
    ] = None,
    idempotency_key: IdempotencyKey = None,
    kp_namespace: NamespaceHeader = None,
) -> ContributionOut:
    services = services_of(request)
    asked = ContributionOptions(
        redact_suspected=redact_suspected,
        suspicious_threshold=suspicious_threshold,
        reject_threshold=reject_threshold,
    )
    options = asked.resolve(services.settings, ("query",))
    if isinstance(options, list):
        raise RequestValidationError(options)
    sent = await _sent_traces(services, request, batch=False)
    given: dict[str, Any] = sent[0] if sent is not None else await request.json()
    body_bytes = len(await request.body())
    errors = lone_surrogate_errors(given, ("body",)) or sent_string_errors(
        given, services.settings.max_string_chars, body_bytes=body_bytes
    )
    if errors:
        raise RequestValidationError(errors)
    (evaluation,) = await _score(services, request, [trace], dry_run=dry_run, batch=False)
    large = body_bytes > INLINE_BODY_BYTES
    return await contribution_answer(
        services,
        evaluation,
        given,
        signed=sent is not None,
        dry_run=dry_run,
        large=large,
        options=options,
    )


def lone_surrogate_errors(given: Any, at: tuple[str, ...]) -> list[dict[str, Any]]:
    """A trace the SDK takes but UTF-8 cannot carry: an error naming where, or none."""
    where = lone_surrogate(given)
    if where is None:
        return []
    msg = "holds a lone surrogate (a \\ud800-\\udfff escape without its pair): not UTF-8 text"
    # A key on the way may hold it: named by its escape, so that the answer is UTF-8.
    named = [
        part.encode("utf-8", "backslashreplace").decode() if isinstance(part, str) else part
        for part in where
    ]
    return [field_error((*at, *named), msg, "lone_surrogate")]


async def contribution_answer(
    services: Services,
    evaluation: Evaluation,
    given: dict[str, Any],
    *,
    signed: bool,
    dry_run: bool,
    large: bool,
    options: GateOptions | None = None,
) -> ContributionOut:
    """The answer for a scored trace; `given`: the trace as the agent sent it (parsed JSON);
    `signed`: `given` passed the signing check (unsignable_errors); `large`: the text work
    runs off the event loop; `options`: the request's (ContributionOptions.resolve), None:
    the settings'."""
    settings = services.settings
    if options is None:
        resolved = ContributionOptions().resolve(settings)
        assert isinstance(resolved, GateOptions)  # the settings' thresholds were checked
        options = resolved
    score = evaluation.score.value
    work = functools.partial(
        prepare,
        given,
        quality_score=score,
        clean_all=settings.contribution_clean_all,
        redact_suspected=options.redact_suspected,
        suspicious_threshold=options.suspicious_threshold,
        reject_threshold=options.reject_threshold,
    )
    gate = await asyncio.to_thread(work) if large else work()
    threshold = settings.contribution_threshold
    answer = ContributionOut(
        evaluation=evaluation_out(evaluation),
        shareable=score >= threshold,
        threshold=threshold,
        leaks_remain=gate.leaks_remain,
        differs_from_sdk=gate.differs_from_sdk,
        contribution=gate.contribution,
        redactions=[_finding(f) for f in gate.redactions],
        uncleaned=[_finding(f) for f in gate.uncleaned],
        inputs_kept=list(gate.inputs_kept),
        findings=[_finding(f) for f in gate.findings],
        injection=InjectionOut(
            fields=[_risk(f) for f in gate.injection],
            highest=None if gate.highest is None else _risk(gate.highest),
            suspicious_threshold=options.suspicious_threshold,
            reject_threshold=options.reject_threshold,
        ),
    )
    signer = services.signer if signed else None
    if signer is not None:
        # The whole answer is signed: the evaluation as /evaluate's, the cleaned trace by its
        # digest (a registry sent it checks it is the one scored and cleaned here), every
        # other field as the API shows it.
        shown = answer.model_dump(mode="json", exclude={"evaluation", "contribution"})
        claims = contribution_claims(shown, gate.contribution)
        answer.evaluation = evaluation_out(
            evaluation, signer, given, dry_run=dry_run, claims=claims
        )
    return answer


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
