"""What POST /contribution answers (docs/contribution.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from app.schemas.responses import EvaluationOut


class FindingOut(BaseModel):
    path: str = Field(
        description="Where, as a JSON Pointer (RFC 6901) into the trace, e.g. /steps/0/content; "
        "a finding in an object's key names that key's member."
    )
    type: Literal[
        "connection_string",
        "bearer_token",
        "api_key",
        "password",
        "email",
        "phone",
        "ip",
        "filepath",
    ] = Field(description="The SDK's redaction type (its placeholder is [REDACTED:<type>]).")
    count: int = Field(ge=1, description="Matches of that type there.")


class FieldRiskOut(BaseModel):
    path: str = Field(description="The text field, as a JSON Pointer into the trace.")
    score: float = Field(ge=0, le=1, description="The SDK's score: matched weight over the total.")
    max_score: float = Field(description="The SDK's maxScore: the weight of all its rules.")
    patterns: list[str] = Field(description="The rules that matched, in the SDK's order.")
    verdict: Literal["safe", "suspicious", "rejected"] = Field(
        description="The SDK's verdict at its default thresholds: rejected from 0.6, "
        "suspicious from 0.3."
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


class ContributionOut(BaseModel):
    evaluation: EvaluationOut = Field(
        description="The POST /evaluate answer for the trace, committed to the memory as "
        "/evaluate commits it (not with dry_run). Its signature, with signing on, also carries "
        "contribution_sha256: the SHA-256 of `contribution`'s RFC 8785 canonical JSON."
    )
    shareable: bool = Field(
        description="Whether the SDK's capture would contribute it: score >= threshold."
    )
    threshold: float = Field(description="KP_CONTRIBUTION_THRESHOLD (the SDK's 0.75).")
    contribution: dict[str, Any] = Field(
        description="The trace as the SDK's capture sends it (given whether or not shareable): "
        "metadata.quality_score set to evaluation.score, each step's content and "
        "output_summary cleaned at the trace's privacy_level, its input too (as JSON text, "
        "parsed back; kept as it was when that no longer parses); JavaScript's key order and "
        "numbers. With KP_CONTRIBUTION_CLEAN_ALL, every other string is cleaned as well."
    )
    redactions: list[FindingOut] = Field(description="What the cleaning removed, field by field.")
    uncleaned: list[FindingOut] = Field(
        description="Secrets and identifiers that go as they are: in what the SDK does not "
        "clean (objective, outcome, metadata, tool names, an input kept as it was, ...), at "
        "the trace's privacy_level. Empty with KP_CONTRIBUTION_CLEAN_ALL."
    )
    inputs_kept: list[str] = Field(
        description="Steps' inputs sent as they were: their cleaned JSON text did not parse "
        "(as in the SDK, which then keeps the original); their findings are in `uncleaned`."
    )
    injection: InjectionOut = Field(
        description="The SDK's classifyInjectionRisk on each text field: content that other "
        "agents will read."
    )
