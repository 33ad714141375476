"""The services' results as the API's answers: the one place that maps one to the other, so
that the schemas know nothing of the services."""

from __future__ import annotations

from dataclasses import asdict

from app.schemas.responses import (
    CacheBackendOut,
    DimensionsOut,
    EvaluationOut,
    NoveltyOut,
    ProfileOut,
    SnapshotOut,
    WeightsOut,
)
from app.services.evaluator import Evaluation
from app.store.base import BackendInfo
from app.store.sqlite_memory import StorageStatus


def evaluation_out(evaluation: Evaluation, signature: str | None = None) -> EvaluationOut:
    s, n, w, d = (
        evaluation.score,
        evaluation.novelty,
        evaluation.score.weights,
        evaluation.score.dimensions,
    )
    return EvaluationOut(
        trace_id=evaluation.trace_id,
        score=s.value,
        dimensions=DimensionsOut.model_validate(d, from_attributes=True),
        weights=WeightsOut(
            profile=w.name,
            complexity=w.complexity,
            novelty=w.novelty,
            tool_diversity=w.tool_diversity,
            outcome_confidence=w.outcome_confidence,
        ),
        profile=ProfileOut(name=w.name, domain_recognised=s.domain_recognised),
        overrides=list(s.overrides),
        novelty=NoveltyOut.model_validate(n, from_attributes=True),
        elapsed_ms=round(evaluation.elapsed_ms, 3),
        signature=signature,
    )


def backend_out(info: BackendInfo) -> CacheBackendOut:
    return CacheBackendOut(**asdict(info))


def snapshot_out(status: StorageStatus) -> SnapshotOut:
    fields = asdict(status)
    fields["path"] = str(status.path) if status.path else None
    return SnapshotOut(**fields)
