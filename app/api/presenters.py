"""The services' results as the API's answers: the one place that maps one to the other, so
that the schemas know nothing of the services."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from app.core.signatures import UNSIGNED_FIELDS
from app.memory.base import BackendInfo
from app.memory.sqlite import StorageStatus
from app.schemas.responses import (
    CacheBackendOut,
    DimensionsOut,
    EvaluationOut,
    NoveltyOut,
    ProfileOut,
    SnapshotOut,
    StorageOut,
    WeightsOut,
)
from app.service.evaluator import Evaluation

if TYPE_CHECKING:  # joserfc loads only when something is signed
    from app.service.signing import Signer


def evaluation_out(
    evaluation: Evaluation,
    signer: Signer | None = None,
    trace: Any = None,
    *,
    dry_run: bool = False,
    claims: Mapping[str, Any] | None = None,
) -> EvaluationOut:
    """The answer for one evaluation; with a `signer`, signed: the answer's own fields as the
    API shows them (so that every field it shows is covered), `trace` as it was sent, and a
    route's own `claims`."""
    s, n, w, d = (
        evaluation.score,
        evaluation.novelty,
        evaluation.score.weights,
        evaluation.score.dimensions,
    )
    out = EvaluationOut(
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
    )
    if signer is not None:
        shown = out.model_dump(mode="json", exclude=set(UNSIGNED_FIELDS))
        out.signature = signer.sign(shown, trace, dry_run=dry_run, claims=claims)
    return out


def backend_out(info: BackendInfo) -> CacheBackendOut:
    return CacheBackendOut(**asdict(info))


def storage_out(status: StorageStatus) -> StorageOut:
    fields = asdict(status)
    fields["path"] = str(status.path) if status.path else None
    return StorageOut(**fields)


#: `snapshot`'s names for `storage`'s fields (deprecated; removed in the next release).
SNAPSHOT_NAMES = {
    "last_commit_at_ms": "last_saved_at_ms",
    "last_write_error": "last_save_error",
    "commits_total": "saves_total",
    "write_errors_total": "save_errors_total",
}


def snapshot_out(storage: StorageOut) -> SnapshotOut:
    fields = {SNAPSHOT_NAMES.get(k, k): v for k, v in storage.model_dump().items()}
    return SnapshotOut(**fields)
