"""Service settings, read once from `KP_*` environment variables.

Each field's `description` is the user's documentation: docs/configuration.md is generated
from it at build time (docs/hooks/settings.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "KP_"


class ConfigError(SystemExit):
    """Bad configuration: the process stops with a message naming the variable."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    embedder: Literal["onnx", "none"] = Field(
        "onnx",
        description="`onnx`: all-MiniLM-L6-v2 through onnxruntime measures novelty; `none`: no "
        "model, novelty is 0.5 and every answer says it was not measured.",
    )
    model_path: Path | None = Field(
        None,
        description="Another all-MiniLM-L6-v2 ONNX export (inputs `input_ids`, "
        "`attention_mask`, `token_type_ids`; output `last_hidden_state`), e.g. the reference's "
        "fp32 `model.onnx`. Unset: the packaged int8 model, checked by its sha256.",
    )
    tokenizer_path: Path | None = Field(
        None,
        description="The `tokenizer.json` to use with that model. Unset: the bundled one.",
    )
    embedder_preload: bool = Field(
        False,
        description="Load the model before the service reports ready, not at the first trace.",
    )
    embedder_threads: int = Field(
        0,
        ge=0,
        description="onnxruntime intra-op threads of a request that runs alone; `0`: one per core.",
    )
    embedder_spinning: bool = Field(
        True,
        description="`false`: onnxruntime's idle intra-op threads sleep instead of spinning "
        "(steadier latency on hosts whose cores other work keeps busy; the same vectors).",
    )
    embedder_workers: int = Field(
        0,
        ge=0,
        le=64,
        description="Model runs side by side under load, one core each; `0`: one per core "
        "this process may use. Above 1 a second, single-threaded session is loaded (about "
        "110 MiB more); `1`: one run at a time over all cores.",
    )
    embedder_precision: Literal["float32", "int8"] = Field(
        "float32",
        description="`float32`: the reference's vectors. `int8`: int8 activations, about twice "
        "the throughput under load with scores within 0.01, on x86-64 CPUs with VNNI or AVX2; "
        "elsewhere declined (float32 served, said in `/readyz` and the log).",
    )
    model_cache_dir: Path | None = Field(
        None,
        description="Where onnxruntime's optimised graph of the model is kept between starts "
        "(about 90 MB per model, precision, onnxruntime version and CPU). Unset: "
        "`$XDG_CACHE_HOME/kp-scoring/onnx` (`~/.cache/...`); one it cannot write: no cache, "
        "with a warning.",
    )
    model_cache: bool = Field(
        True,
        description="Keep the model's optimised graph on disk for later starts (faster, the "
        "same vectors bit for bit); `false`: optimised at every start, nothing written.",
    )

    cache_capacity: int = Field(
        1000, ge=1, description="Vectors the novelty memory keeps; the oldest is evicted first."
    )
    max_namespaces: int = Field(
        1000,
        ge=1,
        description="Namespaces that may hold entries at once, each a memory of its own "
        "with `KP_CACHE_CAPACITY` and `KP_CACHE_TTL_MS`; a trace or import that would start "
        "one more is refused (409, nothing stored) until one is cleared or has expired.",
    )
    cache_ttl_ms: float | None = Field(
        None,
        gt=0,
        description="Entries expire after this many milliseconds (`604800000` is a week). "
        "Unset: they never expire.",
    )
    # The lines are checked before any is added, so a request's entries are held until its end.
    cache_import_max_bytes: int = Field(
        64 * 1_048_576,
        ge=1_048_576,
        description="Largest `POST /cache/import` body (NDJSON, about 2.1 kB an entry: 64 "
        "MiB is about 30,000 entries); send more in several requests.",
    )
    cache_db_path: Path | None = Field(
        None,
        description="The SQLite database that keeps the in-process memory (every namespace) "
        "across restarts; each trace added is committed before its answer. Unset: "
        "`$XDG_DATA_HOME/kp-scoring/memory.db` (`~/.local/share/...`; the image's "
        "`/data/memory.db`); `:memory:`: no file. A snapshot of the former format is converted "
        "at start (kept as `<name>.old-format`). Refused with `KP_REDIS_URL` or "
        "`KP_EMBEDDER=none`, which keep no file (docs/operating/persistence.md).",
    )
    cache_durability: Literal["process", "power"] = Field(
        "process",
        description="What a committed trace survives. `process`: a crash or kill of the "
        "process loses nothing answered; a power loss may lose the last commits (SQLite "
        "`synchronous=NORMAL`, WAL). `power`: a power loss loses nothing answered either; each "
        "commit waits for the disk's flush (`synchronous=FULL`, shared by concurrent requests; "
        "the cost: docs/operating/persistence.md).",
    )
    cache_snapshot_path: Path | None = Field(
        None,
        description="Deprecated (removed in the next release): the former name of "
        "`KP_CACHE_DB_PATH`, still read, with a warning in the log.",
    )
    cache_journal_fsync: Literal["everysec", "always", "off"] | None = Field(
        None,
        description="Deprecated (removed in the next release): read as `KP_CACHE_DURABILITY` "
        "(`always`: `power`; `everysec` and `off`: `process`), with a warning in the log.",
    )
    cache_snapshot_interval_s: float | None = Field(
        None,
        gt=0,
        description="Deprecated (removed in the next release): ignored, with a warning in the "
        "log; every change is committed before its answer, there is no snapshot to time.",
    )

    admin_token: SecretStr | None = Field(
        None,
        description="Bearer token for the `/cache` routes, beside the admin keys of "
        "`KP_API_KEYS_FILE`. With neither, `/cache` is open (logged, and shown in `/readyz`).",
    )
    api_keys_file: Path | None = Field(
        None,
        description="JSON file of API keys (stored as their SHA-256), scopes and rates: scoring "
        "then needs a key of scope `evaluate`, `/cache` one of scope `admin` (or "
        "`KP_ADMIN_TOKEN`). Unset: scoring is open.",
    )
    signing_key_file: Path | None = Field(
        None,
        description="PEM Ed25519 private key: every 200 answer carries `signature`, a compact "
        "JWS. Unset: `signature` is `null`.",
    )
    signing_previous_keys_file: Path | None = Field(
        None,
        description="PEM public keys of earlier signing keys, still published in the JWKS "
        "after a rotation.",
    )
    signing_issuer: str = Field(
        "kp-scoring", min_length=1, max_length=200, description="The `iss` claim of signed scores."
    )
    signing_audience: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="Set: every signed score carries it as `aud`, the party the scores are "
        "for (a registry's name), which a verifier checks (docs/operating/signatures.md).",
    )
    signing_lifetime_s: int | None = Field(
        None,
        ge=1,
        description="Set: every signed score carries `exp`, this many seconds after it was "
        "signed, past which it no longer verifies. Unset: signed scores do not expire.",
    )
    embed_memo_capacity: int = Field(
        4096,
        ge=0,
        le=1_000_000,
        description="Vectors of recently embedded texts kept by the SHA-256 of the text "
        "(about 1.6 KiB each), so that a commit after a dry run or a retry runs no model; "
        "`0`: off.",
    )

    # A secret: it may carry a password.
    redis_url: SecretStr | None = Field(
        None,
        description="`redis://[[user]:password@]host[:port][/db]` or `rediss://...` (TLS): the "
        "novelty memory is shared by every replica with the same URL and prefix. Unset: the "
        "memory lives in the process.",
    )
    redis_prefix: str = Field(
        "kp:",
        min_length=1,
        max_length=200,
        pattern=r"^[^\s{}]+$",
        description="Key prefix in that Redis (several services or environments can share "
        "one Redis). No braces: a namespace's keys carry its name as their hash tag.",
    )
    # 250 ms: past a slow disk's fsync stall and a busy event loop's delays, yet within a few
    # times the 100 ms budget (docs/performance.md) when Redis is gone.
    redis_timeout_ms: float = Field(
        250.0,
        gt=0,
        le=60_000,
        description="Longest a request waits for Redis; past it novelty is not measured "
        "(`cache_unavailable`).",
    )

    # Why 10,000: docs/decisions/flat-then-hnsw.md.
    redis_hnsw_from: int = Field(
        10_000,
        ge=0,
        description="With `KP_REDIS_URL`: entries from which a namespace's searches move "
        "from Redis's exact FLAT index to an HNSW index (answers then say "
        "`search: index`); `0`: FLAT at any size.",
    )
    redis_hnsw_m: int = Field(
        16, ge=4, le=128, description="The HNSW graph's links per entry (Redis's `M`)."
    )
    redis_hnsw_ef_construction: int = Field(
        200,
        ge=16,
        le=4096,
        description="The HNSW graph's breadth while it is built (`EF_CONSTRUCTION`): "
        "higher finds better links, for more of Redis's time per add.",
    )
    redis_hnsw_ef_runtime: int = Field(
        800,
        ge=8,
        le=8192,
        description="The HNSW search's breadth (`EF_RUNTIME`): higher finds the exact "
        "maximum more often, for more of Redis's time per search; what 800 and 200 give at a "
        "million and 100,000 entries: docs/operating/large-memory.md.",
    )

    max_body_bytes: int = Field(1_048_576, ge=1024, description="Larger request bodies get 413.")
    max_batch: int = Field(64, ge=1, le=10_000, description="Traces per batch request.")
    max_steps: int = Field(1000, ge=1, description="Steps per trace.")
    max_string_chars: int = Field(
        100_000, ge=1, description="Characters in any one string of a trace."
    )
    max_json_depth: int = Field(
        32,
        ge=4,
        le=1000,
        description="Nesting of arrays and objects in a body (checked before parsing).",
    )
    embed_batch_size: int = Field(
        32,
        ge=1,
        le=1024,
        description="Texts one model run takes at most (concurrent requests share runs; "
        "`int8` runs each text alone).",
    )
    embed_queue_limit: int = Field(
        256, ge=1, description="Texts waiting for the model beyond which requests get 503 at once."
    )
    # A limit for real overload, not for latency (docs/decisions/overload-is-a-queue.md).
    embed_max_wait_ms: float = Field(
        10_000.0,
        gt=0,
        description="Longest a request may wait for the model before its run starts; past it, 503.",
    )

    # Connection bounds, and why these values: docs/operating/slow-clients.md.
    header_timeout_s: float = Field(
        15.0,
        gt=0,
        le=60,
        description="From connect (or the end of the previous answer) to the request's last "
        "header line; past it the connection is closed without an answer (an idle "
        "kept-alive one too). At most 60 (the server's bound).",
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        le=600,
        description="From the request's headers to its body's last byte; past it, 408 and "
        "close (1 MiB at 35 KB/s fits).",
    )
    max_header_bytes: int = Field(
        32_768,
        ge=8192,
        le=1_048_576,
        description="Request line plus header lines, in bytes (the server's HTTP/1 buffer); "
        "past it, 431 (nginx's default). At most 100 header lines are taken, whatever "
        "their size.",
    )

    metrics_namespaces: int = Field(
        20,
        ge=0,
        le=10_000,
        description="Namespaces that get a `namespace` label of their own in the metrics "
        "(the first this process scores); the others are counted together as `(other)`, "
        "so that tenants cannot grow the metrics without bound.",
    )
    contribution_threshold: float = Field(
        0.75,
        ge=0,
        le=1,
        description="POST /contribution: a trace is `shareable` when its score is at least "
        "this (the reference SDK's capture contributes from 0.75).",
    )
    contribution_clean_all: bool = Field(
        False,
        description="POST /contribution: also clean what the SDK's capture sends as it was (the "
        "objective, the outcome, the metadata, ...) at the trace's privacy_level; their "
        "findings move from `uncleaned` to `redactions` (differs_from_sdk says so).",
    )
    contribution_redact_suspected: bool = Field(
        False,
        description="POST /contribution: what KP_CONTRIBUTION_CLEAN_ALL does, and also redact "
        "every suspected leak the detectors find (`findings` move to `redactions`, "
        "differs_from_sdk says so); a request's redact_suspected overrides it.",
    )
    injection_suspicious_threshold: float = Field(
        0.3,
        ge=0,
        le=1,
        description="POST /contribution: the injection classifier's suspiciousThreshold (the "
        "reference SDK's 0.3): a field scoring at least this is `suspicious`; at most "
        "KP_INJECTION_REJECT_THRESHOLD. A request's suspicious_threshold overrides it.",
    )
    injection_reject_threshold: float = Field(
        0.6,
        ge=0,
        le=1,
        description="POST /contribution: the injection classifier's rejectThreshold (the "
        "reference SDK's 0.6): a field scoring at least this is `rejected`. A request's "
        "reject_threshold overrides it.",
    )

    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log lines below this level are not written."
    )

    @property
    def scoring_open(self) -> bool:
        """Scoring needs no key: KP_API_KEYS_FILE is unset."""
        return self.api_keys_file is None

    @property
    def cache_open(self) -> bool:
        """/cache needs no key: neither KP_ADMIN_TOKEN nor KP_API_KEYS_FILE is set (a keys file
        without an admin key closes /cache to all but KP_ADMIN_TOKEN)."""
        return self.admin_token is None and self.api_keys_file is None

    @property
    def model_cache_location(self) -> Path | None:
        """Where the model's optimised graph is kept (None: not kept, KP_MODEL_CACHE=false or
        no user cache directory)."""
        if not self.model_cache:
            return None
        return self.model_cache_dir or user_cache_directory()

    @property
    def embedder_worker_count(self) -> int:
        """KP_EMBEDDER_WORKERS, with 0 resolved to the cores this process may run on."""
        return self.embedder_workers or len(os.sched_getaffinity(0))

    @field_validator(
        "model_path",
        "tokenizer_path",
        "api_keys_file",
        "signing_key_file",
        "signing_previous_keys_file",
    )
    @classmethod
    def _must_exist(cls, path: Path | None) -> Path | None:
        if path is not None and not path.is_file():
            raise ValueError(f"no such file: {path}")
        return path

    @field_validator("admin_token", "redis_url")
    @classmethod
    def _blank_is_unset(cls, value: SecretStr | None) -> SecretStr | None:
        return value if value is None or value.get_secret_value().strip() else None

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, url: SecretStr | None) -> SecretStr | None:
        """A usable redis:// or rediss:// URL; the message never repeats the URL, which may
        hold a password."""
        if url is None:
            return None
        parts = urlsplit(url.get_secret_value())
        if parts.scheme not in ("redis", "rediss"):
            got = f"scheme {parts.scheme!r}" if parts.scheme else "no scheme"
            raise ValueError(
                "must be a redis:// or rediss:// URL "
                f"(redis://[[user]:password@]host[:port][/db]); it has {got}"
            )
        if not parts.hostname:
            raise ValueError("names no host (redis://host:6379/0)")
        if parts.path not in ("", "/") and not parts.path.lstrip("/").isdigit():
            raise ValueError("the path must be a database number (redis://host:6379/0)")
        from redis.connection import parse_url  # only with KP_REDIS_URL: redis is slow to import

        parse: Callable[[str], object] = parse_url  # untyped in redis-py
        try:
            parse(url.get_secret_value())
        except ValueError as exc:
            raise ValueError(f"not a usable Redis URL: {exc}") from None
        return url

    @model_validator(mode="before")
    @classmethod
    def _former_names(cls, data: Any) -> Any:
        """The deprecated persistence settings read as their replacements (the new name wins),
        then the memory's database file: the one given (MEMORY_ONLY: none), else the default
        one, but none with KP_REDIS_URL (Redis keeps the memory) or KP_EMBEDDER=none."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("cache_db_path") is None and data.get("cache_snapshot_path") is not None:
            data["cache_db_path"] = data["cache_snapshot_path"]
        fsync = data.get("cache_journal_fsync")
        if data.get("cache_durability") is None and fsync is not None:
            data["cache_durability"] = "power" if fsync == "always" else "process"
        given = data.get("cache_db_path")
        redis = data.get("redis_url")
        if isinstance(redis, SecretStr):
            redis = redis.get_secret_value()
        if given is not None and str(given).strip():
            data["cache_db_path"] = None if str(given) == MEMORY_ONLY else given
        elif (redis is not None and str(redis).strip()) or data.get("embedder") == "none":
            data["cache_db_path"] = None
        else:
            data["cache_db_path"] = default_memory_file()
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.injection_suspicious_threshold > self.injection_reject_threshold:
            raise ValueError(
                "KP_INJECTION_SUSPICIOUS_THRESHOLD "
                f"({self.injection_suspicious_threshold}) exceeds KP_INJECTION_REJECT_THRESHOLD "
                f"({self.injection_reject_threshold}): suspicious would never be said"
            )
        # The database path's variable, as the operator wrote it.
        former = self.cache_snapshot_path == self.cache_db_path
        db_path = f"{ENV_PREFIX}{'CACHE_SNAPSHOT_PATH' if former else 'CACHE_DB_PATH'}"
        if self.redis_url is not None and self.cache_db_path is not None:
            raise ValueError(
                f"{db_path} and KP_REDIS_URL are both set: with Redis the shared cache is kept "
                f"by Redis's own persistence (AOF), not by a database file; unset {db_path}"
            )
        if self.embedder == "none" and self.cache_db_path is not None:
            raise ValueError(
                f"{db_path} is set with KP_EMBEDDER=none: without a model there is no model "
                "identity to keep vectors under, and nothing kept could be trusted at the next "
                f"start; unset {db_path} or run the model"
            )
        return self

    def deprecation_warnings(self) -> list[str]:
        """One line for each deprecated setting in use (logged at start)."""
        replaced = {
            "cache_snapshot_path": "KP_CACHE_DB_PATH",
            "cache_journal_fsync": "KP_CACHE_DURABILITY (always: power; everysec, off: process)",
            "cache_snapshot_interval_s": "nothing: every change is committed before its answer",
        }
        return [
            f"{ENV_PREFIX}{name.upper()} is deprecated and goes in the next release: use {instead}"
            for name, instead in replaced.items()
            if getattr(self, name) is not None
        ]

    @classmethod
    def from_env(cls) -> Settings:
        """Settings from the environment, or ConfigError naming each bad variable."""
        try:
            return cls()
        except ValidationError as exc:
            # A check across variables (loc empty) names them in its message.
            problems = "; ".join(
                f"{ENV_PREFIX}{'_'.join(str(p) for p in err['loc']).upper()}: {err['msg']}"
                if err["loc"]
                else err["msg"].removeprefix("Value error, ")
                for err in exc.errors()
            )
            raise ConfigError(f"kp-scoring: invalid configuration: {problems}") from None


#: Settings no longer read, and what took their place: a start given one logs it
#: (retired_settings), and goes on.
RETIRED = {
    "CACHE_SEARCH": "the in-process memory searches exactly at any size; the shared one by "
    "Redis's FLAT index, then HNSW from KP_REDIS_HNSW_FROM entries",
    "CACHE_INDEX_THRESHOLD": "the in-process memory searches exactly at any size; "
    "KP_REDIS_HNSW_FROM is the shared memory's",
    "CACHE_INDEX_EF_SEARCH": "KP_REDIS_HNSW_EF_RUNTIME is the shared memory's",
    "CACHE_INDEX_EF_SEARCH_FAR": "Redis's HNSW search has no second search",
    "CACHE_INDEX_SHARE": "the shared memory's index lives in Redis, for every replica",
}


def retired_settings() -> list[str]:
    """One line for each retired KP_* variable that is set."""
    return [
        f"{ENV_PREFIX}{name} is no longer read: {instead}"
        for name, instead in RETIRED.items()
        if f"{ENV_PREFIX}{name}" in os.environ
    ]


#: KP_CACHE_DB_PATH's value for a memory kept in the process only (SQLite's own name for a
#: database that is not a file).
MEMORY_ONLY: Final = ":memory:"


def default_memory_file() -> Path | None:
    """$XDG_DATA_HOME/kp-scoring/memory.db, or ~/.local/share/kp-scoring/memory.db; None when
    neither is known (no HOME): the memory is then kept in the process only."""
    return _user_directory("XDG_DATA_HOME", ".local/share", "memory.db")


def user_cache_directory() -> Path | None:
    """$XDG_CACHE_HOME/kp-scoring/onnx, or ~/.cache/kp-scoring/onnx; None when neither is
    known: no cache then, rather than a shared place such as /tmp, where another user could
    plant a graph."""
    return _user_directory("XDG_CACHE_HOME", ".cache", "onnx")


def _user_directory(variable: str, fallback: str, name: str) -> Path | None:
    base = os.environ.get(variable)
    if not base:
        try:
            base = str(Path.home() / fallback)
        except (KeyError, RuntimeError):  # no HOME, a uid without a passwd entry
            return None
    return Path(base) / "kp-scoring" / name


def config_error(variable: str, problem: str) -> ConfigError:
    """The error that stops the start over one variable (`variable` without its prefix)."""
    return ConfigError(f"kp-scoring: invalid configuration: {ENV_PREFIX}{variable}: {problem}")


def redis_location(url: str) -> str:
    """The URL as operators may see it: scheme, user, host, port and database, no password."""
    parts = urlsplit(url)
    user = f"{parts.username}@" if parts.username else ""
    host = f"[{parts.hostname}]" if parts.hostname and ":" in parts.hostname else parts.hostname
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{user}{host}{port}{parts.path or ''}"
