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


def weights_for(task_domain: str) -> WeightProfile:
    """The profile named by the domain, else `default` (a dict lookup: `constructor` is unknown)."""
    return WEIGHT_PROFILES.get(task_domain, WEIGHT_PROFILES["default"])


class ToolLike(Protocol):
    @property
    def name(self) -> str: ...


class StepLike(Protocol):
    @property
    def type(self) -> str: ...
    @property
    def tool(self) -> ToolLike | None: ...


@dataclass(frozen=True, slots=True)
class StepStats:
    """Counts over a trace's steps that the formulas need."""

    step_count: int
    unique_types: int
    error_recoveries: int
    unique_tools: int
    uses_tools: bool
    single_thought: bool

    @classmethod
    def of(cls, steps: Sequence[StepLike]) -> StepStats:
        types, tools, recoveries, tool_steps = set(), set(), 0, 0
        for step in steps:
            types.add(step.type)
            recoveries += step.type == "error_recovery"
            if step.tool is not None:
                tools.add(step.tool.name)
                tool_steps += 1
        return cls(
            step_count=len(steps),
            unique_types=len(types),
            error_recoveries=recoveries,
            unique_tools=len(tools),
            uses_tools=tool_steps > 0,
            single_thought=len(steps) == 1 and steps[0].type == "thought",
        )


def complexity(stats: StepStats) -> float:
    recovery = 0.3 if stats.error_recoveries > 0 else 0
    return min(
        1.0,
        (stats.unique_types / 4) * 0.5 + recovery + (stats.step_count / 20) * 0.2,
    )


def tool_diversity(stats: StepStats) -> float:
    return min(1.0, (stats.unique_tools / max(1, stats.step_count)) * 3)


def outcome_confidence(confidence: float, success: bool) -> float:
    return confidence * (1.0 if success else 0.3)


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
    stats: StepStats,
    *,
    novelty: float,
    confidence: float,
    success: bool,
    task_domain: str,
) -> Score:
    """The composite score with its breakdown (docs/scoring.md)."""
    dims = Dimensions(
        complexity=complexity(stats),
        novelty=novelty,
        tool_diversity=tool_diversity(stats),
        outcome_confidence=outcome_confidence(confidence, success),
    )
    w = weights_for(task_domain)
    value = (
        dims.complexity * w.complexity
        + dims.novelty * w.novelty
        + dims.tool_diversity * w.tool_diversity
        + dims.outcome_confidence * w.outcome_confidence
    )
    fired: list[OverrideName] = []
    if stats.single_thought:
        value = 0.1
        fired.append("single_thought")
    if stats.error_recoveries > 2 and success:
        value = min(1.0, value + 0.1)
        fired.append("error_recovery_bonus")
    if stats.unique_tools <= 1 and stats.uses_tools:
        value = max(0.0, value - 0.1)
        fired.append("low_tool_diversity")
    return Score(
        value=value,
        dimensions=dims,
        weights=w,
        overrides=tuple(fired),
        domain_recognised=task_domain in WEIGHT_PROFILES,
    )
