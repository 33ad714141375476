"""Service settings, read once from `KP_*` environment variables (SPEC section 9)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "KP_"


class ConfigError(SystemExit):
    """Bad configuration: the process stops with a message naming the variable."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    embedder: Literal["onnx", "none"] = "onnx"
    model_path: Path | None = None
    tokenizer_path: Path | None = None
    embedder_preload: bool = False
    #: With `python -m app.serve`: the model starts loading when the process starts, beside
    #: the imports and the server's start-up, without holding readiness back (the preload does).
    embedder_early_load: bool = True
    embedder_threads: Annotated[int, Field(ge=0)] = 0  # 0: onnxruntime's choice (all cores)
    #: false: the intra-op threads sleep when idle instead of spinning (hosts with busy cores).
    embedder_spinning: bool = True
    #: Model runs side by side under load, one core each; 0: one per core this process may use.
    embedder_workers: Annotated[int, Field(ge=0, le=64)] = 0
    #: int8: 1.4-1.9x faster per text, scores within 0.01 of float32, on x86-64 CPUs with VNNI
    #: or AVX2; declined (float32, said in /readyz and the log) elsewhere (README, "int8 mode").
    embedder_precision: Literal["float32", "int8"] = "float32"
    #: The model's optimised graph is kept here between starts and loaded as it is (a faster
    #: start, the same vectors); unset: $XDG_CACHE_HOME/kp-scoring/onnx (~/.cache/...).
    model_cache_dir: Path | None = None
    #: false: the graph is optimised at every start and nothing is written.
    model_cache: bool = True

    cache_capacity: Annotated[int, Field(ge=1)] = 1000
    cache_ttl_ms: Annotated[float, Field(gt=0)] | None = None
    #: exact: the exact scan at any size (operators check the index with it); auto: an
    #: approximate index proposes candidates, rescored exactly, from KP_CACHE_INDEX_THRESHOLD
    #: entries on (README, "A large memory").
    cache_search: Literal["exact", "auto"] = "auto"
    cache_index_threshold: Annotated[int, Field(ge=1_000)] = 20_000
    #: The graph's search breadth (faiss efSearch): higher finds the exact maximum more often,
    #: for more time a query (README, "The memory at size").
    cache_index_ef_search: Annotated[int, Field(ge=16, le=4_096)] = 128
    #: The breadth of a second search for a query whose best candidate's cosine is below 0.75
    #: (far from everything: where the first search misses); 0: no second search (README,
    #: "The memory at size").
    cache_index_ef_search_far: Annotated[int, Field(ge=0, le=8_192)] = 1024
    #: With KP_REDIS_URL: a replica that builds the graph publishes it in Redis (about 0.9 kB
    #: an entry more there), and a starting replica adopts the published one instead of
    #: building (README, "A large memory"). false: each replica builds its own.
    cache_index_share: bool = True
    #: Largest POST /cache/import body (NDJSON, about 2.1 kB a 384-float entry); the lines
    #: are checked before any is added, so a request's entries are held until its end.
    cache_import_max_bytes: Annotated[int, Field(ge=1_048_576)] = 64 * 1_048_576
    cache_snapshot_path: Path | None = None
    cache_snapshot_interval_s: Annotated[float, Field(gt=0)] = 30.0

    admin_token: SecretStr | None = None
    #: Set: scoring needs an API key of this JSON file with scope `evaluate`, /cache one with
    #: `admin` (or KP_ADMIN_TOKEN); keys are stored as SHA-256 (app/core/api_keys.py).
    api_keys_file: Path | None = None
    #: Set: every 200 answer carries a JWS signed with this Ed25519 private key (PEM).
    signing_key_file: Path | None = None
    #: PEM public keys of earlier signing keys, still published in the JWKS after a rotation.
    signing_previous_keys_file: Path | None = None
    signing_issuer: Annotated[str, Field(min_length=1, max_length=200)] = "kp-scoring"
    #: Vectors of recently embedded texts kept (by SHA-256 of the text), so that a commit after
    #: a dry run or a retry runs no model; about 1.6 KiB each; 0: off.
    embed_memo_capacity: Annotated[int, Field(ge=0, le=1_000_000)] = 4096

    #: Set: the novelty cache is shared, through this Redis, by every replica that uses it and
    #: the same prefix (SPEC 6). A secret: it may carry a password.
    redis_url: SecretStr | None = None
    redis_prefix: Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[^\s]+$")] = "kp:"
    #: Longest a request waits for Redis; past it, novelty is not measured (cache_unavailable).
    #: A healthy exchange takes well under 1 ms locally and a few ms across a network; 250 ms
    #: is past an fsync stall of a slow disk (appendfsync always) and past the event loop's
    #: delays on a busy two-core machine, so it does not fire under load, yet keeps a request
    #: within a few times SPEC 7's 100 ms when Redis is gone.
    redis_timeout_ms: Annotated[float, Field(gt=0, le=60_000)] = 250.0

    max_body_bytes: Annotated[int, Field(ge=1024)] = 1_048_576
    max_batch: Annotated[int, Field(ge=1, le=10_000)] = 64
    max_steps: Annotated[int, Field(ge=1)] = 1000
    max_string_chars: Annotated[int, Field(ge=1)] = 100_000
    max_json_depth: Annotated[int, Field(ge=4, le=1000)] = 32
    #: Texts one model run takes at most (micro-batching of concurrent requests).
    embed_batch_size: Annotated[int, Field(ge=1, le=1024)] = 32
    #: Texts waiting for the model beyond which requests are turned away with 503 at once.
    embed_queue_limit: Annotated[int, Field(ge=1)] = 256
    #: Longest wait for the model before a request's run starts; past it, 503. A limit for real
    #: overload, not for latency: 10 s is about 70 full-window texts on a CPU where one takes
    #: 140 ms, so bursts and closed-loop clients on slow CPUs are served, later, not refused.
    embed_max_wait_ms: Annotated[float, Field(gt=0)] = 10_000.0

    # Connection bounds (docs/operating/slow-clients.md): the header deadline and size are
    # granian's (app/serve.py hands them over), the body deadline the app's own
    # (app/api/asgi/request_bounds.py), so that slow or silent clients cannot hold descriptors.
    header_timeout_s: Annotated[float, Field(gt=0, le=60)] = Field(
        15.0,
        description="From connect (or the end of the previous answer) to the request's last "
        "header line; past it the connection is closed (an idle kept-alive one too). An honest "
        "request's headers are under 1 KB, one packet; 15 s outlasts several TCP "
        "retransmissions on a lossy link. At most 60 (granian's bound).",
    )
    body_timeout_s: Annotated[float, Field(gt=0, le=600)] = Field(
        30.0,
        description="From the request's headers to its body's last byte; past it, 408 and "
        "close. 30 s takes the 1 MiB body limit at 35 KB/s and a typical trace (a few KB) at "
        "well under 1 KB/s.",
    )
    max_header_bytes: Annotated[int, Field(ge=8192, le=1_048_576)] = Field(
        32_768,
        description="Request line plus header lines, in bytes (granian's HTTP/1 buffer); past "
        "it, 431 and close. 32 KiB: nginx's default (large_client_header_buffers 4 8k). At "
        "most 100 header lines are taken whatever their size (431 past them).",
    )

    log_level: Literal["debug", "info", "warning", "error"] = "info"

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

    @field_validator("admin_token")
    @classmethod
    def _token_not_blank(cls, token: SecretStr | None) -> SecretStr | None:
        if token is not None and not token.get_secret_value().strip():
            return None  # an empty variable means "unset"
        return token

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, url: SecretStr | None) -> SecretStr | None:
        if url is None or not url.get_secret_value().strip():
            return None  # an empty variable means "unset"
        check_redis_url(url.get_secret_value())
        return url

    @model_validator(mode="after")
    def _one_persistence(self) -> Settings:
        if self.redis_url is not None and self.cache_snapshot_path is not None:
            raise ValueError(
                "KP_CACHE_SNAPSHOT_PATH and KP_REDIS_URL are both set: with Redis the shared "
                "cache is kept by Redis's own persistence (AOF), not by snapshot files; "
                "unset KP_CACHE_SNAPSHOT_PATH"
            )
        return self

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


def config_error(variable: str, problem: str) -> ConfigError:
    """The error that stops the start over one variable (`variable` without its prefix)."""
    return ConfigError(f"kp-scoring: invalid configuration: {ENV_PREFIX}{variable}: {problem}")


def check_redis_url(url: str) -> None:
    """ValueError unless `url` is a usable redis:// or rediss:// URL; the message never
    repeats the URL, which may hold a password."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        got = f"scheme {parts.scheme!r}" if parts.scheme else "no scheme"
        raise ValueError(
            "must be a redis:// or rediss:// URL (redis://[[user]:password@]host[:port][/db]); "
            f"it has {got}"
        )
    if not parts.hostname:
        raise ValueError("names no host (redis://host:6379/0)")
    if parts.path not in ("", "/") and not parts.path.lstrip("/").isdigit():
        raise ValueError("the path must be a database number (redis://host:6379/0)")
    from redis.connection import parse_url  # only with KP_REDIS_URL: redis is slow to import

    parse: Callable[[str], object] = parse_url  # untyped in redis-py
    try:
        parse(url)
    except ValueError as exc:
        raise ValueError(f"not a usable Redis URL: {exc}") from None


def redis_location(url: str) -> str:
    """The URL as operators may see it: scheme, user, host, port and database, no password."""
    parts = urlsplit(url)
    user = f"{parts.username}@" if parts.username else ""
    host = f"[{parts.hostname}]" if parts.hostname and ":" in parts.hostname else parts.hostname
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{user}{host}{port}{parts.path or ''}"
