"""The model's load started with the process (KP_EMBEDDER_EARLY_LOAD, app/services/early_load.py):
it begins before any request, /healthz and /readyz answer while it runs, readiness is not held
back by it, and a load that fails degrades exactly as a failed lazy load does."""

from __future__ import annotations

import gc
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.core.config import Settings
from app.core.version import VERSION
from app.embedding.onnx_embedder import OnnxEmbedder
from app.main import create_app
from app.services import early_load
from tests.factories import make_trace
from tests.server import SERVE, LiveServer

#: The service as `python -m app.serve` runs it, except that the model's load (early or lazy)
#: waits for the file named by $LOAD_GATE to exist: the test decides when the load may go on.
HELD = (
    sys.executable,
    "-c",
    "import os, time\n"
    "from app.embedding import model_files\n"
    "verify = model_files.verify\n"
    "def held(files):\n"
    "    while not os.path.exists(os.environ['LOAD_GATE']):\n"
    "        time.sleep(0.01)\n"
    "    return verify(files)\n"
    "model_files.verify = held\n"
    "from app.serve import main\n"
    "main()\n",
)


def _until(live: LiveServer, done: Any) -> dict[str, Any]:
    """/readyz once `done(body)` holds (a bound for a hung server, not a timing check)."""
    deadline = time.monotonic() + 120
    while True:
        body: dict[str, Any] = live.client.get("/readyz").json()
        if done(body) or time.monotonic() > deadline:
            return body
        time.sleep(0.05)


@pytest.fixture
def servers() -> Iterator[list[LiveServer]]:
    """Servers started by a test, stopped after it."""
    started: list[LiveServer] = []
    yield started
    for live in started:
        live.stop()


pytestmark = pytest.mark.server


def test_the_model_loads_before_the_first_request_and_healthz_answers_meanwhile(
    tmp_path: Path, servers: list[LiveServer]
) -> None:
    gate = tmp_path / "gate"
    env = {"LOAD_GATE": str(gate), "KP_LOG_LEVEL": "info"}
    live = LiveServer(env, tmp_path / "server.log", HELD)  # returns once /healthz answers
    servers.append(live)
    assert live.client.get("/healthz").json() == {"status": "ok", "version": VERSION}
    ready = live.client.get("/readyz").json()
    # The load began with the process and is held: the service is up, and ready meanwhile
    # (readiness waits for the model only with KP_EMBEDDER_PRELOAD).
    assert ready["embedder"]["state"] == "loading"
    assert ready["status"] == "ready"
    gate.touch()
    ready = _until(live, lambda body: body["embedder"]["state"] != "loading")
    assert ready["embedder"]["state"] == "ready"  # no trace was sent
    assert "/evaluate" not in live.log()
    assert '"embedder ready"' in live.log()
    first = live.post("/evaluate", make_trace()).json()
    assert first["novelty"]["reason"] == "cache_empty"
    again = live.post("/evaluate", make_trace()).json()
    assert again["novelty"]["measured"] is True
    assert again["novelty"]["max_cosine"] == pytest.approx(1.0, abs=1e-6)


def test_without_early_load_the_model_waits_for_the_first_trace(
    tmp_path: Path, servers: list[LiveServer]
) -> None:
    gate = tmp_path / "gate"
    gate.touch()
    env = {"LOAD_GATE": str(gate), "KP_EMBEDDER_EARLY_LOAD": "false", "KP_LOG_LEVEL": "info"}
    live = LiveServer(env, tmp_path / "server.log", HELD)
    servers.append(live)
    assert live.client.get("/readyz").json()["embedder"]["state"] == "not_loaded"
    assert live.post("/evaluate", make_trace()).json()["novelty"]["reason"] == "cache_empty"
    assert live.client.get("/readyz").json()["embedder"]["state"] == "ready"


def test_a_failed_early_load_degrades_as_a_failed_lazy_load(
    tmp_path: Path, servers: list[LiveServer]
) -> None:
    broken = tmp_path / "model.onnx"
    broken.write_bytes(b"not an onnx model")
    answers = {}
    for early in ("true", "false"):
        env = {"KP_MODEL_PATH": str(broken), "KP_EMBEDDER_EARLY_LOAD": early}
        live = LiveServer({**env, "KP_LOG_LEVEL": "info"}, tmp_path / f"{early}.log", SERVE)
        servers.append(live)
        if early == "true":  # seen before any trace: in /readyz and the log
            ready = _until(live, lambda body: body["embedder"]["state"] != "loading")
            assert ready["embedder"]["state"] == "unavailable"
            assert ready["degraded"] is True
            assert "embedder unavailable; novelty is not measured" in live.log()
        answer = live.post("/evaluate", make_trace())
        assert answer.status_code == 200
        answers[early] = (answer.json()["novelty"], live.client.get("/readyz").json(), live.log())
    (early_novelty, early_ready, early_log), (lazy_novelty, lazy_ready, lazy_log) = (
        answers["true"],
        answers["false"],
    )
    assert early_novelty["reason"] == "embedder_unavailable"
    assert "cannot be loaded" in (early_novelty["detail"] or "")
    assert early_novelty == lazy_novelty
    for key in ("status", "degraded", "embedder", "warnings"):
        assert early_ready[key] == lazy_ready[key]
    for log in (early_log, lazy_log):
        assert log.count("embedder unavailable; novelty is not measured") == 1
        assert early_novelty["detail"] in log.replace('\\"', '"')


def test_the_runtime_takes_over_a_load_only_for_its_own_settings(
    monkeypatch: pytest.MonkeyPatch, embedder: OnnxEmbedder
) -> None:
    monkeypatch.setenv("KP_EMBEDDER_THREADS", "1")
    early_load.start()
    other = early_load.plan_of(Settings(embedder_threads=2))
    assert other is not None
    assert early_load.claim(other) is None  # other settings: the runtime loads its own
    assert early_load.claim(other) is None  # and a load is claimed once at most

    early_load.start()
    plan = early_load.plan_of(Settings.from_env())
    assert plan is not None
    claimed = early_load.claim(plan)
    assert claimed is not None
    loaded = claimed.result()
    loaded.finish_loading()
    texts = ["Review PR #42 for security issues", "a second, longer text " * 20]
    np.testing.assert_array_equal(loaded.embed(texts), embedder.embed(texts))


def test_with_preload_readiness_still_waits_for_the_early_load(
    tmp_path: Path, servers: list[LiveServer]
) -> None:
    env = {"KP_EMBEDDER_PRELOAD": "true", "KP_LOG_LEVEL": "info"}
    live = LiveServer(env, tmp_path / "server.log", SERVE)  # /healthz answers after the start
    servers.append(live)
    ready = live.client.get("/readyz").json()
    assert ready["embedder"]["state"] == "ready"
    log = live.log()
    # Loaded and warmed up before the start completed, as a preload without the early load.
    assert log.index('"embedder warmed up"') < log.index('"kp-scoring started"')
    assert live.post("/evaluate", make_trace()).json()["novelty"]["reason"] == "cache_empty"


@pytest.mark.parametrize("paused", [True, False])
def test_the_collector_paused_for_the_start_is_on_again_once_the_app_has_started(
    paused: bool,
) -> None:
    """app/serve.py stops the cyclic collector for the start (imports make ~140k lasting
    objects); the lifespan freezes what the start made and turns it back on. An app started
    another way (tests, another server) finds it on and leaves it alone."""
    code = f"""
import gc
from fastapi.testclient import TestClient
from app.core.config import Settings
from app.main import create_app

if {paused}:
    gc.disable()
with TestClient(create_app(Settings(embedder="none"))) as client:
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    assert (frozen > 10_000) if {paused} else (frozen == 0), frozen
    assert client.get("/healthz").status_code == 200
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_a_stopped_app_lets_go_of_its_model_and_memory() -> None:
    """fastapi caches endpoint functions for the life of the process, and the /docs ones are
    closures that hold their app: a process that builds apps one after another (the tests,
    a host embedding the service) must not keep every stopped app's model and memory."""
    with TestClient(create_app(Settings()), raise_server_exceptions=False) as client:
        assert client.post("/evaluate", json=make_trace()).status_code == 200
        services = client.app.state.services  # type: ignore[attr-defined]
        model = weakref.ref(services.embeddings.lifecycle.embedder)
        runtime = weakref.ref(services.runtime)
        del services
        assert model() is not None
    gc.collect()
    assert runtime() is None
    assert model() is None
