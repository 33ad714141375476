"""The value score of a reasoning trace: four dimensions, domain weights, rule overrides.

Pure arithmetic (docs/scoring.md), written in the reference SDK's operation order so that
every float comes out bit-for-bit as the reference's `evaluateValue` computes it.
Novelty arrives here as a number; how it is measured lives in `app.service.evaluator`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from app.core.states import OverrideName

#: Novelty when it cannot be measured: no embedder, or nothing cached to compare with.
NEUTRAL_NOVELTY: Final = 0.5


@dataclass(frozen=True, slots=True)
class WeightProfile:
    name: str
    complexity: float
    novelty: float
    tool_diversity: float
    outcome_confidence: float


WEIGHT_PROFILES: Final[dict[str, WeightProfile]] = {
    p.name: p
    for p in (
        WeightProfile("default", 0.25, 0.35, 0.15, 0.25),
        WeightProfile("finance", 0.2, 0.25, 0.1, 0.45),
        WeightProfile("code", 0.2, 0.3, 0.3, 0.2),
        WeightProfile("medical", 0.15, 0.2, 0.1, 0.55),
        WeightProfile("customer_service", 0.2, 0.3, 0.2, 0.3),
    )
}


class ToolLike(Protocol):
    @property
    def name(self) -> str: ...


class StepLike(Protocol):
    @property
    def type(self) -> str: ...
    @property
    def tool(self) -> ToolLike | None: ...


def novelty_text(objective: str, contents: Sequence[str | None]) -> str:
    """The text whose embedding novelty compares: the objective, a space, the step contents."""
    return objective + " " + " ".join(content or "" for content in contents)


def novelty(max_cosine: float) -> float:
    """1 - the nearest cached vector's cosine, clamped to [0, 1]: a deliberate difference from
    the reference SDK (docs/scoring.md)."""
    return min(1.0, max(0.0, 1.0 - max_cosine))


@dataclass(frozen=True, slots=True)
class Dimensions:
    complexity: float
    novelty: float
    tool_diversity: float
    outcome_confidence: float


@dataclass(frozen=True, slots=True)
class Score:
    value: float
    dimensions: Dimensions
    weights: WeightProfile
    overrides: tuple[OverrideName, ...]
    #: Whether `task_domain` named a profile; if not, the default profile applied.
    domain_recognised: bool


def score(
    steps: Sequence[StepLike],
    *,
    novelty: float,
    confidence: float,
    success: bool,
    task_domain: str,
) -> Score:
    """The composite score with its breakdown (docs/scoring.md)."""
    types, tools, recoveries, uses_tools = set(), set(), 0, False
    for step in steps:
        types.add(step.type)
        recoveries += step.type == "error_recovery"
        if step.tool is not None:
            tools.add(step.tool.name)
            uses_tools = True
    recovery = 0.3 if recoveries > 0 else 0
    dims = Dimensions(
        complexity=min(1.0, (len(types) / 4) * 0.5 + recovery + (len(steps) / 20) * 0.2),
        novelty=novelty,
        tool_diversity=min(1.0, (len(tools) / max(1, len(steps))) * 3),
        outcome_confidence=confidence * (1.0 if success else 0.3),
    )
    # A dict lookup: a name a JavaScript object inherits (`constructor`) is unknown.
    w = WEIGHT_PROFILES.get(task_domain, WEIGHT_PROFILES["default"])
    value = (
        dims.complexity * w.complexity
        + dims.novelty * w.novelty
        + dims.tool_diversity * w.tool_diversity
        + dims.outcome_confidence * w.outcome_confidence
    )
    fired: list[OverrideName] = []
    if len(steps) == 1 and steps[0].type == "thought":
        value = 0.1
        fired.append("single_thought")
    if recoveries > 2 and success:
        value = min(1.0, value + 0.1)
        fired.append("error_recovery_bonus")
    if len(tools) <= 1 and uses_tools:
        value = max(0.0, value - 0.1)
        fired.append("low_tool_diversity")
    return Score(value, dims, w, tuple(fired), domain_recognised=task_domain in WEIGHT_PROFILES)
