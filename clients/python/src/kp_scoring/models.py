"""What the service answers, as the client reads it.

The names are the components of the service's OpenAPI document (openapi/openapi.json), and
tests/test_client_models.py holds each model's fields to that document. The models are
lenient where a newer service may say more: fields it adds are kept (`model_extra`), and
names of states and reasons are plain strings rather than a closed list, so that a client
keeps working against a service one version ahead.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class _Answer(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)


class DimensionsOut(_Answer):
    complexity: float
    novelty: float
    tool_diversity: float
    outcome_confidence: float


class WeightsOut(_Answer):
    profile: str
    complexity: float
    novelty: float
    tool_diversity: float
    outcome_confidence: float


class ProfileOut(_Answer):
    #: The weight profile that applied (as weights.profile).
    name: str
    #: Whether the trace's task_domain names a profile; if not, the default one applied.
    domain_recognised: bool


class NearestOut(_Answer):
    #: The id of the stored trace ('' if it was stored without one). Stored data: print it
    #: through `kp_scoring.text.visible`.
    trace_id: str
    cosine: float
    age_ms: float


class NoveltyOut(_Answer):
    measured: bool
    #: embedder_unavailable, embedding_failed, cache_empty or cache_unavailable.
    reason: str | None
    detail: str | None = None
    max_cosine: float | None
    cache_size: int
    tokens: int | None
    truncated: bool | None
    nearest: NearestOut | None = None
    #: How max_cosine was found: "exact", or "index" (an approximate search of a large
    #: memory, at most search_bound below the exact maximum); None when not measured.
    search: str | None = None
    search_bound: float | None = None
    #: The trace is in the memory now, committed (None from an older service, which did not
    #: say); else not_stored says why: dry_run, not_measured, cache_unavailable,
    #: storage_failed (with the storage's reason in not_stored_detail).
    stored: bool | None = None
    not_stored: str | None = None
    not_stored_detail: str | None = None


class EvaluationOut(_Answer):
    trace_id: str
    score: float
    dimensions: DimensionsOut
    weights: WeightsOut
    profile: ProfileOut | None = None  # None from an older service, which did not say it
    #: single_thought, error_recovery_bonus, low_tool_diversity.
    overrides: list[str]
    novelty: NoveltyOut
    elapsed_ms: float
    signature: str | None = None


class BatchOut(_Answer):
    results: list[EvaluationOut]


class FindingOut(_Answer):
    #: A JSON Pointer (RFC 6901) into the trace, e.g. /steps/0/content.
    path: str
    #: connection_string, bearer_token, api_key, password, email, phone, ip, filepath (the
    #: SDK's), private_key, jwt, card_number, ssn, high_entropy_string (the detectors').
    type: str
    count: int
    #: Who found it: cleanPii (the SDK's patterns) or a detector (None from an older service).
    detector: str | None = None


class FieldRiskOut(_Answer):
    path: str
    score: float
    max_score: float
    patterns: list[str]
    #: safe, suspicious or rejected.
    verdict: str


class InjectionOut(_Answer):
    fields: list[FieldRiskOut]
    highest: FieldRiskOut | None
    #: The thresholds the verdicts used (None from an older service: the SDK's 0.3 and 0.6).
    suspicious_threshold: float | None = None
    reject_threshold: float | None = None


class ContributionOut(_Answer):
    """POST /contribution: the score, and the trace as the SDK's capture would send it."""

    evaluation: EvaluationOut
    shareable: bool
    threshold: float
    #: Whether something suspected is left in `contribution` (None from an older service).
    leaks_remain: bool | None = None
    #: Whether `contribution` is not the SDK's (the service redacted more).
    differs_from_sdk: bool | None = None
    contribution: dict[str, Any]
    redactions: list[FindingOut]
    uncleaned: list[FindingOut]
    inputs_kept: list[str]
    #: Suspected leaks the SDK's patterns leave, by place, type and detector.
    findings: list[FindingOut] = []
    injection: InjectionOut


class EmbedderOut(_Answer):
    state: str
    model: str | None
    weights: str | None = None  # how the model's file stores them (int8); not its arithmetic
    precision: str | None  # the arithmetic it runs in: float32 or int8
    precision_reason: str | None
    reason: str | None


class CacheBackendOut(_Answer):
    kind: str
    shared: bool
    location: str | None
    prefix: str | None
    available: bool
    reason: str | None
    outages_total: int


class CacheOut(_Answer):
    #: The namespace these figures are of (None from a service without namespaces).
    namespace: str | None = None
    size: int
    capacity: int
    dimensions: int
    ttl_ms: float | None
    memory_bytes: int
    oldest_age_ms: float | None
    newest_age_ms: float | None
    adds_total: int
    evictions_total: int
    embedder: EmbedderOut
    backend: CacheBackendOut


class ClearedOut(_Answer):
    cleared: int


class NamespacesOut(_Answer):
    namespaces: list[str]
    limit: int


class StorageOut(_Answer):
    """The in-process memory's database."""

    path: str | None
    state: str
    detail: str | None
    loaded_vectors: int
    last_commit_at_ms: float | None
    last_write_error: str | None
    commits_total: int
    write_errors_total: int
    checksum_failures_total: int
    durability: str | None


class ReadyOut(_Answer):
    status: str
    degraded: bool
    embedder: EmbedderOut
    cache_size: int
    cache_backend: CacheBackendOut
    admin_auth: bool
    #: None from a 0.1.0 service, which sends `snapshot` only.
    storage: StorageOut | None = None
    #: Deprecated: `storage` under the 0.1.0 names; the next release leaves it out.
    snapshot: dict[str, Any] | None = None
    warnings: list[str]
