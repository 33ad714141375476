"""What the service answers, as the client reads it.

The names are the components of the service's OpenAPI document (openapi/openapi.json), and
tests/test_client_models.py holds each model's fields to that document. The models are
lenient where a newer service may say more: fields it adds are kept (`model_extra`), and
names of states and reasons are plain strings rather than a closed list, so that a client
keeps working against a service one version ahead.
"""

from __future__ import annotations

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


class EmbedderOut(_Answer):
    state: str
    model: str | None
    precision: str | None
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


class SnapshotOut(_Answer):
    path: str | None
    state: str
    detail: str | None
    loaded_vectors: int
    last_saved_at_ms: float | None
    last_save_error: str | None
    saves_total: int
    save_errors_total: int
    #: The in-process memory's database (None from an older service, which kept snapshots).
    checksum_failures_total: int | None = None
    durability: str | None = None


class ReadyOut(_Answer):
    status: str
    degraded: bool
    embedder: EmbedderOut
    cache_size: int
    cache_backend: CacheBackendOut
    admin_auth: bool
    snapshot: SnapshotOut
    warnings: list[str]
