"""The model's load started with the process (`python -m app.serve`), in a thread beside the
web stack's imports and uvicorn's start-up: the first trace then finds the model loaded, or
partly so. Most of a load (hashing the file, building the onnxruntime session) runs without
the GIL, so it overlaps the imports on the other core.

The thread reads the settings and resolves the files as the app factory will; the runtime the
factory builds takes the load over (`claim`) when its settings, files and int8 choice are the
same, and loads as usual otherwise. A load that fails fails alike either way: the runtime meets
the same exception from the thread as from its own call. Nothing here logs; the runtime does.
This module imports nothing heavy at import time: the thread does that, off the main thread's
path."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.core.config import Settings
    from app.embedding.int8_support import Int8Support
    from app.embedding.model_files import ModelFiles
    from app.embedding.onnx_embedder import OnnxEmbedder


@dataclass(frozen=True, slots=True)
class Plan:
    """What the load is for: the factory's runtime takes it over only for the same."""

    settings: Settings
    files: ModelFiles
    int8: Int8Support | None


@dataclass(slots=True)
class _Pending:
    plan: Future[Plan | None] = field(default_factory=Future)
    embedder: Future[OnnxEmbedder] = field(default_factory=Future)


_pending: _Pending | None = None
_lock = threading.Lock()


def start() -> None:
    """Starts the load in a daemon thread, once per process (a process that stops before it
    ends does not wait for it)."""
    global _pending
    with _lock:
        if _pending is not None:
            return
        _pending = _Pending()
        pending = _pending
    threading.Thread(target=_load, args=(pending,), name="kp-early-load", daemon=True).start()


def claim(plan: Plan) -> Future[OnnxEmbedder] | None:
    """The load started with the process, when it is for `plan`; once (None afterwards, or
    when no load was started, the settings ask for none or differ)."""
    global _pending
    with _lock:
        pending, _pending = _pending, None
    if pending is None:
        return None
    # Set within moments of the thread's start: the settings and file paths, no model work.
    if pending.plan.result() != plan:
        return None
    return pending.embedder


def load_embedder(files: ModelFiles, settings: Settings, int8: Int8Support | None) -> OnnxEmbedder:
    """The least a first answer needs: the embedding service finishes loading after it (or
    before the service reports ready, with KP_EMBEDDER_PRELOAD)."""
    from app.embedding import model_files
    from app.embedding.onnx_embedder import OnnxEmbedder
    from app.embedding.session_cache import SessionCache, default_directory

    directory = (settings.model_cache_dir or default_directory()) if settings.model_cache else None
    cache = None if directory is None else SessionCache(directory)
    # The file's hash (hashlib leaves the GIL) runs beside the tokenizer's load.
    with ThreadPoolExecutor(1, thread_name_prefix="kp-model-check") as check:
        sha256 = check.submit(model_files.verify, files)
        return OnnxEmbedder(
            files.model,
            files.tokenizer,
            intra_op_threads=settings.embedder_threads,
            spinning=settings.embedder_spinning,
            concurrent_runs=settings.embedder_worker_count,
            precision="float32" if int8 is None else int8.precision,
            int8_weights=None if int8 is None else int8.weights,
            defer=True,
            session_cache=cache,
            model_sha256=sha256.result,
        )


def plan_of(settings: Settings) -> Plan | None:
    """The load these settings ask for (None: no model); ModelError when the files are
    missing."""
    from app.embedding import model_files
    from app.embedding.int8_support import int8_support

    if settings.embedder == "none":
        return None
    files = model_files.resolve(settings.model_path, settings.tokenizer_path)
    int8 = int8_support(None) if settings.embedder_precision == "int8" else None
    return Plan(settings, files, int8)


def _load(pending: _Pending) -> None:
    try:
        from app.core.config import Settings

        settings = Settings.from_env()
        plan = plan_of(settings) if settings.embedder_early_load else None
    except BaseException:  # a bad setting or a missing file: the factory meets and reports it
        plan = None
    pending.plan.set_result(plan)
    if plan is None:
        return
    try:
        pending.embedder.set_result(load_embedder(plan.files, plan.settings, plan.int8))
    except BaseException as exc:  # handed to the runtime, which reports it as its own load's
        pending.embedder.set_exception(exc)
