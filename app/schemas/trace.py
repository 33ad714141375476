"""The ReasoningTrace input schema (docs/scoring.md, "The trace").

Mirrors the reference SDK's zod `ReasoningTraceSchema`: unknown keys are ignored, types are
strict (no "true" for a boolean, no "1" for a number), numbers must be finite, and an optional
field may be left out but is never null (zod's `.optional()` rejects null).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from app.schemas.ids import TraceId

# Some doc pages show the second address; the spec accepts both.
KpContext = Literal[
    "https://openknowledgepulse.org/schema/v1",
    "https://knowledgepulse.dev/schema/v1",
]

StepType = Literal["thought", "tool_call", "observation", "error_recovery"]

# zod's `z.string().datetime()`: UTC in the Z form, seconds and their fraction optional. The
# pattern is the whole rule (dates that exist, 0001 to 9999, leap years; no offset, no leap
# second), so that the published schema states it exactly; ASCII digits only.
_YEAR = "(?:000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"
_MONTH_DAY = (
    "(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
    "|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    "|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_TIME = "T(?:[01][0-9]|2[0-3]):[0-5][0-9](?::[0-5][0-9](?:[.][0-9]+)?)?Z"
DATETIME_PATTERN = f"^(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29){_TIME}$"
_DATETIME = re.compile(DATETIME_PATTERN)


def _iso_datetime(value: str) -> str:
    if not _DATETIME.fullmatch(value):  # fullmatch: `$` alone would allow a final newline
        raise ValueError("must be a UTC date-time in the Z form, such as 2025-06-15T10:00:00.000Z")
    return value


def _integral_number(value: Any) -> Any:
    # JSON has one number type: 3.0 is the integer 3 for the reference (zod .int()).
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _not_null(value: Any) -> Any:
    # Runs on input only: a field left out gets its default (None) without validation.
    if value is None:
        raise PydanticCustomError("null_not_allowed", "Field may be omitted, but not null")
    return value


def _without_null(schema: dict[str, Any]) -> None:
    # pydantic documents `X | None = None` as `anyOf [X, null]` with `default: null`; the
    # field accepts X or nothing, so the published schema says only X (and not required).
    schema.pop("default", None)
    (present,) = [branch for branch in schema.pop("anyOf") if branch != {"type": "null"}]
    schema.update(present)


_T = TypeVar("_T")

# zod's `.optional()`: absent reads as None, an explicit null is a 422 naming the field.
Omittable = Annotated[_T | None, BeforeValidator(_not_null), Field(json_schema_extra=_without_null)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore", frozen=True)


NonEmptyStr = Annotated[str, Field(min_length=1)]
UnitInterval = Annotated[float, Field(ge=0, le=1)]
IsoDateTime = Annotated[
    str, AfterValidator(_iso_datetime), Field(json_schema_extra={"pattern": DATETIME_PATTERN})
]
JsonObject = dict[str, Any]


class Metadata(_Strict):
    created_at: IsoDateTime
    agent_id: Omittable[str] = None
    framework: Omittable[str] = None
    task_domain: NonEmptyStr
    success: bool
    quality_score: UnitInterval
    visibility: Literal["private", "org", "network"]
    privacy_level: Literal["aggregated", "federated", "private"]
    validated_by: Omittable[list[str]] = None


class Task(_Strict):
    objective: NonEmptyStr
    input_schema: Omittable[JsonObject] = None


class Tool(_Strict):
    name: str
    mcp_server: Omittable[str] = None


class Step(_Strict):
    step_id: Annotated[int, Field(ge=0), BeforeValidator(_integral_number)]
    type: StepType
    content: Omittable[str] = None
    tool: Omittable[Tool] = None
    input: Omittable[JsonObject] = None
    output_summary: Omittable[str] = None
    latency_ms: Omittable[Annotated[float, Field(ge=0)]] = None


class Outcome(_Strict):
    result_summary: str
    confidence: UnitInterval


class Entity(_Strict):
    name: str
    type: str


class Relationship(_Strict):
    fact: str
    valid_from: str


class KnowledgeGraphDelta(_Strict):
    entities: list[Entity]
    relationships: list[Relationship]


class ReasoningTrace(_Strict):
    """A reasoning trace as an agent submits it for scoring."""

    context: KpContext = Field(alias="@context")
    type: Literal["ReasoningTrace"] = Field(alias="@type")
    id: TraceId
    source_skill: Omittable[str] = None
    metadata: Metadata
    task: Task
    steps: Annotated[list[Step], Field(min_length=1)]
    outcome: Outcome
    knowledge_graph_delta: Omittable[KnowledgeGraphDelta] = None
