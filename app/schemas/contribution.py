"""What POST /contribution answers (docs/contribution.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.core.config import Settings
from app.core.errors import ServiceError
from app.schemas.responses import EvaluationOut

REDACT_SUSPECTED = (
    "Also clean every string the SDK's capture sends as it was (as KP_CONTRIBUTION_CLEAN_ALL) "
    "and redact every suspected leak the detectors find ([REDACTED:<type>]): the "
    "contribution then differs from the SDK's (differs_from_sdk). Default: "
    "KP_CONTRIBUTION_REDACT_SUSPECTED."
)
SUSPICIOUS_THRESHOLD = (
    "The injection classifier's suspiciousThreshold (the SDK's option): a field scoring at "
    "least this is suspicious. 0 to 1, at most reject_threshold. Default: "
    "KP_INJECTION_SUSPICIOUS_THRESHOLD."
)
REJECT_THRESHOLD = (
    "The injection classifier's rejectThreshold (the SDK's option): a field scoring at least "
    "this is rejected. 0 to 1, at least suspicious_threshold. Default: "
    "KP_INJECTION_REJECT_THRESHOLD."
)


class ContributionOptions(BaseModel):
    """What a request may ask of the gate beyond the trace (POST /contribution's query
    parameters, kp_check_contribution's arguments); unset: the settings'."""

    model_config = ConfigDict(strict=True)

    redact_suspected: bool | None = Field(None, description=REDACT_SUSPECTED)
    suspicious_threshold: float | None = Field(
        None, ge=0, le=1, allow_inf_nan=False, description=SUSPICIOUS_THRESHOLD
    )
    reject_threshold: float | None = Field(
        None, ge=0, le=1, allow_inf_nan=False, description=REJECT_THRESHOLD
    )

    def resolve(self, settings: Settings, at: tuple[str, ...] = ()) -> GateOptions:
        """The options with the settings' defaults, or ServiceError (422, naming the option at
        `at`) when the two thresholds cannot be taken together."""
        redact, suspicious = self.redact_suspected, self.suspicious_threshold
        reject = self.reject_threshold
        options = GateOptions(
            settings.contribution_redact_suspected if redact is None else redact,
            settings.injection_suspicious_threshold if suspicious is None else suspicious,
            settings.injection_reject_threshold if reject is None else reject,
        )
        if options.suspicious_threshold <= options.reject_threshold:
            return options
        problem = (
            f"the suspicious threshold ({options.suspicious_threshold}) must not exceed the "
            f"reject threshold ({options.reject_threshold}): 0 <= suspicious <= reject <= 1"
        )
        # Named by the one the request set (both: the suspicious one), so the fix is clear.
        name = "reject_threshold" if suspicious is None else "suspicious_threshold"
        raise ServiceError(422, "threshold_order", problem, loc=(*at, name))


@dataclass(frozen=True, slots=True)
class GateOptions:
    redact_suspected: bool
    suspicious_threshold: float
    reject_threshold: float


#: The SDK's cleanPii types (its placeholder is [REDACTED:<type>]).
SdkLeakType = Literal[
    "connection_string", "bearer_token", "api_key", "password", "email", "phone", "ip", "filepath"
]
#: Those and the detectors' others.
LeakType = Literal[SdkLeakType, "private_key", "jwt", "card_number", "ssn", "high_entropy_string"]


class FindingOut(BaseModel):
    path: str = Field(
        description="Where, as a JSON Pointer (RFC 6901) into the trace, e.g. /steps/0/content "
        "or /steps/2/input/headers/Authorization; a finding in an object's key names that "
        "key's member."
    )
    type: LeakType = Field(
        description="What it is: the SDK's redaction types (connection_string, bearer_token, "
        "api_key, password, email, phone, ip, filepath), and the detectors' private_key, jwt, "
        "card_number, ssn, high_entropy_string. Redacted as [REDACTED:<type>]."
    )
    count: int = Field(ge=1, description="Matches of that type there.")
    detector: str = Field(
        description="Who found it: cleanPii (the SDK's own patterns), else a detector of "
        "docs/contribution.md (detect-secrets AWSKeyDetector, phonenumbers, stdnum luhn, ...)."
    )


class FieldRiskOut(BaseModel):
    path: str = Field(description="The text field, as a JSON Pointer into the trace.")
    score: float = Field(ge=0, le=1, description="The SDK's score: matched weight over the total.")
    max_score: float = Field(description="The SDK's maxScore: the weight of all its rules.")
    patterns: list[str] = Field(description="The rules that matched, in the SDK's order.")
    verdict: Literal["safe", "suspicious", "rejected"] = Field(
        description="The SDK's verdict at the thresholds of `injection`: rejected from "
        "reject_threshold, suspicious from suspicious_threshold (the score before rounding)."
    )


class InjectionOut(BaseModel):
    fields: list[FieldRiskOut] = Field(
        description="Each text field of the trace as the agent sent it (before cleaning), in "
        "the trace's order; fields of a fixed form (@context, @type, id, created_at, "
        "visibility, privacy_level, a step's type) and object keys are not read."
    )
    highest: FieldRiskOut | None = Field(
        description="The field with the highest score (the first of equals)."
    )
    suspicious_threshold: float = Field(
        ge=0,
        le=1,
        description="The SDK's suspiciousThreshold the verdicts used: the request's, else "
        "KP_INJECTION_SUSPICIOUS_THRESHOLD (the SDK's 0.3).",
    )
    reject_threshold: float = Field(
        ge=0,
        le=1,
        description="The SDK's rejectThreshold the verdicts used: the request's, else "
        "KP_INJECTION_REJECT_THRESHOLD (the SDK's 0.6).",
    )


class ContributionOut(BaseModel):
    evaluation: EvaluationOut = Field(
        description="The POST /evaluate answer for the trace, committed to the memory as "
        "/evaluate commits it (not with dry_run). Its signature, with signing on, covers the "
        "whole answer: the evaluation as /evaluate's does, `contribution` by its digest "
        "(contribution_sha256: the SHA-256 of its RFC 8785 canonical JSON) and every other "
        "field below (the claim contribution_answer)."
    )
    shareable: bool = Field(
        description="Whether the SDK's capture would contribute it: score >= threshold. The "
        "score's verdict only: see leaks_remain for what it would leak."
    )
    threshold: float = Field(description="KP_CONTRIBUTION_THRESHOLD (the SDK's 0.75).")
    leaks_remain: bool = Field(
        description="Whether `contribution` still holds something suspected: an entry of "
        "`uncleaned` (the SDK's patterns match it) or of `findings` (a detector suspects it). "
        "False: neither finds anything left (heuristics: not a proof that nothing leaks)."
    )
    differs_from_sdk: bool = Field(
        description="Whether `contribution` is not what the SDK's capture would send: the "
        "gate cleaned more (KP_CONTRIBUTION_CLEAN_ALL, or redact_suspected) and found "
        "something to clean. False: it is the SDK's, to the character."
    )
    contribution: dict[str, Any] = Field(
        description="The trace as the SDK's capture sends it (given whether or not shareable): "
        "metadata.quality_score set to evaluation.score, each step's content and "
        "output_summary cleaned at the trace's privacy_level, its input too (as JSON text, "
        "parsed back; kept as it was when that no longer parses); JavaScript's key order and "
        "numbers. With KP_CONTRIBUTION_CLEAN_ALL every other string is cleaned as well; with "
        "redact_suspected, that and every suspected leak (differs_from_sdk says so)."
    )
    redactions: list[FindingOut] = Field(
        description="What the cleaning removed, field by field (with clean_all or "
        "redact_suspected, what the gate removed beyond the SDK too, by its detector)."
    )
    uncleaned: list[FindingOut] = Field(
        description="Matches of the SDK's own patterns in what goes as it is: in what the SDK "
        "does not clean (objective, outcome, metadata, tool names, an input kept as it was, "
        "...), and in a step's input, each string its pass over the input's JSON text left "
        'unchanged though the pattern matches the string itself (JSON escaping: `\\"` ends a '
        "password's value, `\\\\` breaks a Windows path); at the trace's privacy_level. "
        "Empty with KP_CONTRIBUTION_CLEAN_ALL or redact_suspected."
    )
    inputs_kept: list[str] = Field(
        description="Steps' inputs sent as they were: their cleaned JSON text did not parse "
        "(as in the SDK, which then keeps the original); their findings are in `uncleaned`."
    )
    findings: list[FindingOut] = Field(
        description="Suspected leaks the SDK's patterns leave in `contribution`: each named "
        "by its place, type, count and detector, never by its text (docs/contribution.md "
        "lists the detectors). Identifiers (email, phone, ip, ssn) are not looked for at "
        "privacy_level private, where the SDK keeps them. Empty with redact_suspected: they "
        "are in `redactions`."
    )
    injection: InjectionOut = Field(
        description="The SDK's classifyInjectionRisk on each text field: content that other "
        "agents will read."
    )
