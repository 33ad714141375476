"""Service settings, read once from `KP_*` environment variables (SPEC section 9)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator
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
    embedder_threads: Annotated[int, Field(ge=0)] = 0  # 0: onnxruntime's choice (all cores)
    #: Model runs side by side under load, one core each; 0: one per core this process may use.
    embedder_workers: Annotated[int, Field(ge=0, le=64)] = 0
    #: int8: 1.4-1.9x faster per text, scores within 0.01 of float32, on x86-64 CPUs with VNNI
    #: or AVX2; declined (float32, said in /readyz and the log) elsewhere (README, "int8 mode").
    embedder_precision: Literal["float32", "int8"] = "float32"

    cache_capacity: Annotated[int, Field(ge=1)] = 1000
    cache_ttl_ms: Annotated[float, Field(gt=0)] | None = None
    cache_snapshot_path: Path | None = None
    cache_snapshot_interval_s: Annotated[float, Field(gt=0)] = 30.0

    admin_token: SecretStr | None = None

    max_body_bytes: Annotated[int, Field(ge=1024)] = 1_048_576
    max_batch: Annotated[int, Field(ge=1, le=10_000)] = 64
    max_steps: Annotated[int, Field(ge=1)] = 1000
    max_string_chars: Annotated[int, Field(ge=1)] = 100_000
    max_json_depth: Annotated[int, Field(ge=4, le=1000)] = 32
    #: Texts one model run takes at most (micro-batching of concurrent requests).
    embed_batch_size: Annotated[int, Field(ge=1, le=1024)] = 32
    #: Texts waiting for the model beyond which requests are turned away with 503.
    embed_queue_limit: Annotated[int, Field(ge=1)] = 256
    #: Longest wait for the model before a request's run starts; past it (or a forecast past 3/4
    #: of it, at the door) the request is turned away with 503 (SPEC 7: a typical evaluation
    #: ends within 100 ms). 60 leaves the rest of the budget for the run a request shares
    #: under load (two texts on one core, about 25 ms in float32 on the bench machine) and for
    #: HTTP, validation and scoring; at 80 the 16-client p99 was 105-110 ms.
    embed_max_wait_ms: Annotated[float, Field(gt=0)] = 60.0

    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @property
    def embedder_worker_count(self) -> int:
        """KP_EMBEDDER_WORKERS, with 0 resolved to the cores this process may run on."""
        return self.embedder_workers or len(os.sched_getaffinity(0))

    @field_validator("model_path", "tokenizer_path")
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

    @classmethod
    def from_env(cls) -> Settings:
        """Settings from the environment, or ConfigError naming each bad variable."""
        try:
            return cls()
        except ValidationError as exc:
            problems = "; ".join(
                f"{ENV_PREFIX}{'_'.join(str(p) for p in err['loc']).upper()}: {err['msg']}"
                for err in exc.errors()
            )
            raise ConfigError(f"kp-scoring: invalid configuration: {problems}") from None
