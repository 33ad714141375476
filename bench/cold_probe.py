"""The probe bench.cold_profile spawns: `python -m bench.cold_probe PORT` runs the service as
`python -m app.serve` does, recording when each step of the start ends (ms since the spawn,
whose perf_counter the driver passes in COLD_PROFILE_SPAWNED: the same monotonic clock in
both processes) and, for the model's steps, their thread's CPU time. The marks are written to
COLD_PROFILE_OUT when the driver's SIGTERM comes. Few imports here: they count in the start."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from functools import wraps
from pathlib import Path
from typing import Any

SPAWNED = "COLD_PROFILE_SPAWNED"
OUT = "COLD_PROFILE_OUT"
HOST = "127.0.0.1"


def probe(port: int) -> None:
    """Runs the service as app.serve does, recording each step's end."""
    spawned = float(os.environ[SPAWNED])
    marks: list[dict[str, Any]] = []

    def mark(step: str, **extra: Any) -> None:
        marks.append(
            {
                "step": step,
                "at_ms": (time.perf_counter() - spawned) * 1000,
                "thread": threading.current_thread().name,
                **extra,
            }
        )

    mark("interpreter started")

    def save() -> None:
        Path(os.environ[OUT]).write_text(json.dumps(marks))

    def timed(owner: Any, name: str, step: str, first_only: bool = False) -> None:
        original = getattr(owner, name)
        seen = [0]

        @wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                seen[0] += 1
                if not first_only or seen[0] <= 2:
                    mark(
                        step if seen[0] == 1 else f"{step} (again)",
                        took_ms=(time.perf_counter() - wall) * 1000,
                        cpu_ms=(time.thread_time() - cpu) * 1000,
                    )

        setattr(owner, name, wrapper)

    # Each part is wrapped once its module is imported where the service imports it (the
    # model's modules on the early-load thread, the runtime's with app.main): importing them
    # here first would move their cost to another thread than the real start's.
    from app.services import early_load

    plan_of = early_load.plan_of

    def planned(settings: Any) -> Any:
        plan = plan_of(settings)
        mark("early load: numpy, onnxruntime imported, files found")
        from app.embedding import model_files, onnx_embedder

        timed(model_files, "verify", "early load: model file sha256 checked")
        timed(onnx_embedder, "load_tokenizer", "early load: tokenizer loaded")
        timed(onnx_embedder, "_read_model", "early load: model file read")
        timed(onnx_embedder.OnnxEmbedder, "_open", "early load: onnxruntime session made")
        timed(onnx_embedder.OnnxEmbedder, "embed_tokenized", "model run", first_only=True)
        finish = onnx_embedder.OnnxEmbedder.finish_loading

        def finish_loading(self: Any) -> None:
            mark("warm-up began (one-core session, long-text window, runs)")
            finish(self)

        onnx_embedder.OnnxEmbedder.finish_loading = finish_loading  # type: ignore[method-assign]
        return plan

    early_load.plan_of = planned

    def wrap_runtime() -> None:
        from app.services import embeddings_lifecycle, runtime

        timed(runtime.Runtime, "__init__", "lifespan: runtime built")
        load = embeddings_lifecycle.ModelLifecycle._load

        async def loaded(self: Any, factory: Any) -> None:
            await load(self, factory)
            cache = getattr(self.embedder, "cache_outcome", None)
            mark("model ready for requests", model_cache=None if cache is None else cache.state)

        embeddings_lifecycle.ModelLifecycle._load = loaded  # type: ignore[method-assign]

    # As app/serve.py's run starts (its own call then finds it done): the collector off,
    # the model's load started, FastAPI imported (its OpenAPI models deferred), then uvicorn.
    from app import serve

    serve.prepare()
    mark("early load started, fastapi imported")
    import uvicorn.config
    import uvicorn.server

    mark("uvicorn imported")

    import uvicorn.importer

    importer = uvicorn.importer.import_from_string

    def import_from_string(import_str: Any) -> Any:
        found = importer(import_str)
        if import_str == "app.main:create_app":
            mark("app.main imported (fastapi, pydantic, the routes)")
            wrap_runtime()

            def factory() -> Any:
                app = found()
                mark("app built (create_app)")
                return app

            return factory
        return found

    uvicorn.config.import_from_string = import_from_string  # type: ignore[attr-defined]
    startup = uvicorn.server.Server.startup

    async def started(self: Any, sockets: Any = None) -> None:
        await startup(self, sockets)
        mark("listening (lifespan done, socket bound)")
        # uvicorn ends the process by its own SIGTERM once shut down (no atexit): the marks
        # are saved when the driver's SIGTERM comes, before uvicorn's handler runs.
        stop = signal.getsignal(signal.SIGTERM)

        def saved_then_stop(signum: int, frame: Any) -> None:
            save()
            if callable(stop):
                stop(signum, frame)

        signal.signal(signal.SIGTERM, saved_then_stop)

    uvicorn.server.Server.startup = started  # type: ignore[method-assign]

    serve.main(["--host", HOST, "--port", str(port)])


if __name__ == "__main__":
    probe(int(sys.argv[1]))
