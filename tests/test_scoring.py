"""The formulas of docs/scoring.md, checked by hand-computed values and properties."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.domain import scoring
from app.schemas.trace import ReasoningTrace
from tests.factories import make_trace, step


def score_of(trace: dict[str, Any], novelty: float = 0.5) -> scoring.Score:
    t = ReasoningTrace.model_validate(trace)
    return scoring.score(
        t.steps,
        novelty=novelty,
        confidence=t.outcome.confidence,
        success=t.metadata.success,
        task_domain=t.metadata.task_domain,
    )


def test_worked_example_of_the_spec() -> None:
    result = score_of(make_trace())
    assert result.dimensions == scoring.Dimensions(0.405, 0.5, 1.0, 1.0)
    assert result.weights.name == "default"
    assert result.overrides == ("low_tool_diversity",)
    assert result.value == pytest.approx(0.57625, abs=1e-12)


@pytest.mark.parametrize(
    ("profile", "weights"),
    [
        ("default", (0.25, 0.35, 0.15, 0.25)),
        ("finance", (0.20, 0.25, 0.10, 0.45)),
        ("code", (0.20, 0.30, 0.30, 0.20)),
        ("medical", (0.15, 0.20, 0.10, 0.55)),
        ("customer_service", (0.20, 0.30, 0.20, 0.30)),
    ],
)
def test_each_profile_weights_the_dimensions(profile: str, weights: tuple[float, ...]) -> None:
    steps = [
        step(0, "thought", "a"),
        step(1, "tool_call", "b", "x"),
        step(2, "tool_call", "c", "y"),
    ]
    result = score_of(make_trace(steps=steps, domain=profile, confidence=0.8))
    w = result.weights
    assert (w.name, w.complexity, w.novelty, w.tool_diversity, w.outcome_confidence) == (
        profile,
        *weights,
    )
    assert sum(weights) == pytest.approx(1.0)
    d = result.dimensions
    expected = sum(
        v * k
        for v, k in zip(
            (d.complexity, d.novelty, d.tool_diversity, d.outcome_confidence), weights, strict=True
        )
    )
    assert result.overrides == ()
    assert result.value == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    "domain",
    ["code-review", "Finance", "constructor", "__proto__", "toString", "hasOwnProperty", "ñ"],
)
def test_unknown_domains_use_default_silently(domain: str) -> None:
    assert score_of(make_trace(domain=domain)).weights.name == "default"
    assert score_of(make_trace(domain=domain)).value == score_of(make_trace()).value


def test_single_thought_step_scores_exactly_0_1() -> None:
    result = score_of(make_trace(steps=[step(0, "thought", "just a thought")]), novelty=1.0)
    assert result.value == 0.1
    assert result.overrides == ("single_thought",)


def test_single_non_thought_step_is_not_overridden() -> None:
    result = score_of(make_trace(steps=[step(0, "observation", "x")]))
    assert result.overrides == ()
    assert result.value != 0.1


def test_single_thought_with_its_one_tool_also_loses_0_1() -> None:
    result = score_of(make_trace(steps=[step(0, "thought", "x", tool="search")]))
    assert result.overrides == ("single_thought", "low_tool_diversity")
    assert result.value == pytest.approx(0.0, abs=1e-15)


def _recoveries(n: int, tools: tuple[str, ...] = ("a", "b")) -> list[dict[str, Any]]:
    steps = [step(0, "thought", "start")]
    steps += [step(i + 1, "error_recovery", f"retry {i}") for i in range(n)]
    steps += [step(len(steps) + i, "tool_call", "call", t) for i, t in enumerate(tools)]
    return steps


def test_error_recovery_bonus_needs_more_than_two_and_success() -> None:
    base = score_of(make_trace(steps=_recoveries(3), success=True, confidence=0.5))
    assert base.overrides == ("error_recovery_bonus",)
    d, w = base.dimensions, base.weights
    weighted = (
        d.complexity * w.complexity
        + d.novelty * w.novelty
        + d.tool_diversity * w.tool_diversity
        + d.outcome_confidence * w.outcome_confidence
    )
    assert base.value == pytest.approx(weighted + 0.1, abs=1e-12)
    assert score_of(make_trace(steps=_recoveries(2), success=True)).overrides == ()
    assert score_of(make_trace(steps=_recoveries(3), success=False)).overrides == ()


def test_error_recovery_bonus_is_capped_at_one() -> None:
    steps = [step(0, "thought", "x"), step(1, "observation", "y")]
    steps += [step(2 + i, "error_recovery", "r", tool=f"t{i}") for i in range(4)]
    result = score_of(make_trace(steps=steps, domain="code"), novelty=1.0)
    assert result.overrides == ("error_recovery_bonus",)
    assert result.value == 1.0


def test_low_tool_diversity_applies_to_one_distinct_tool_on_any_step_type() -> None:
    steps = [step(0, t, "x", tool="same") for t in ("thought", "observation", "error_recovery")]
    result = score_of(make_trace(steps=steps))
    assert result.overrides == ("low_tool_diversity",)
    assert result.dimensions.tool_diversity == 1.0  # 1 tool / 3 steps * 3


def test_bonus_and_penalty_combine() -> None:
    result = score_of(make_trace(steps=_recoveries(3, tools=("only",))))
    assert result.overrides == ("error_recovery_bonus", "low_tool_diversity")


def test_no_tools_means_no_penalty_and_zero_diversity() -> None:
    result = score_of(make_trace(steps=[step(0, "thought"), step(1, "observation")]))
    assert result.overrides == ()
    assert result.dimensions.tool_diversity == 0.0


def test_empty_tool_name_counts_as_a_tool() -> None:
    steps = [step(0, "tool_call", tool=""), step(1, "tool_call", tool="x")]
    assert score_of(make_trace(steps=steps)).dimensions.tool_diversity == 1.0


def test_step_count_term_is_not_capped_on_its_own() -> None:
    forty = [step(i, "thought") for i in range(40)]
    # 1 type: 0.125 + 40/20*0.2 = 0.525 (the step term alone contributes 0.4)
    assert score_of(make_trace(steps=forty)).dimensions.complexity == pytest.approx(0.525)
    many = [
        step(i, t)
        for i, t in enumerate(["thought", "error_recovery", "observation", "tool_call"] * 10)
    ]
    assert score_of(make_trace(steps=many)).dimensions.complexity == 1.0


def test_failure_scales_outcome_by_0_3() -> None:
    assert score_of(make_trace(success=False, confidence=0.5)).dimensions.outcome_confidence == 0.15


@pytest.mark.parametrize(
    ("max_cosine", "novelty"), [(1.0000001, 0.0), (0.25, 0.75), (-0.2, 1.0), (0.0, 1.0)]
)
def test_novelty_is_clamped(max_cosine: float, novelty: float) -> None:
    assert scoring.novelty(max_cosine) == pytest.approx(novelty)


def test_novelty_text_joins_objective_and_contents_with_spaces() -> None:
    assert scoring.novelty_text("obj", ["a", None, "b"]) == "obj a  b"
    assert scoring.novelty_text("obj", [None]) == "obj "


_step = st.fixed_dictionaries(
    {
        "step_id": st.integers(0, 10**6),
        "type": st.sampled_from(["thought", "tool_call", "observation", "error_recovery"]),
    },
    optional={
        "content": st.text(max_size=20),
        "tool": st.fixed_dictionaries({"name": st.sampled_from(["", "a", "b", "c", "d"])}),
    },
)
_trace = st.builds(
    lambda steps, domain, success, confidence: make_trace(
        steps=steps, domain=domain, success=success, confidence=confidence
    ),
    st.lists(_step, min_size=1, max_size=60),
    st.sampled_from([*scoring.WEIGHT_PROFILES, "constructor", "other"]),
    st.booleans(),
    st.floats(0, 1),
)


@given(_trace, st.floats(-1.5, 1.5))
def test_any_valid_trace_scores_within_0_and_1(trace: dict[str, Any], max_cosine: float) -> None:
    result = score_of(trace, novelty=scoring.novelty(max_cosine))
    assert 0.0 <= result.value <= 1.0
    d = result.dimensions
    assert all(
        0.0 <= v <= 1.0 for v in (d.complexity, d.novelty, d.tool_diversity, d.outcome_confidence)
    )
