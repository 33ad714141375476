"""The service is served as FastAPI apps are: `uvicorn app.main:app`, `fastapi run app/main.py`
and gunicorn managing uvicorn workers each start it from the environment (KP_*) and score a
trace (docs/operating/servers.md). uvicorn runs the real model."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import httpx
import pytest

from tests.factories import make_trace
from tests.server import ROOT, free_port

pytestmark = pytest.mark.server

BIN = Path(sys.executable).parent


@contextmanager
def serving(command: list[str], port: int, env: dict[str, str]) -> Iterator[httpx.Client]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KP_")}
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            command, cwd=ROOT, env={**clean, **env}, stdout=log, stderr=subprocess.STDOUT
        )
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        try:
            deadline = time.monotonic() + 120
            while True:
                assert process.poll() is None, _tail(log)
                try:
                    if client.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, _tail(log)
                time.sleep(0.1)
            yield client
        finally:
            client.close()
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _tail(log: IO[bytes]) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")[-3000:]


def test_uvicorn_serves_app_main_app_with_the_model(tmp_path: Path) -> None:
    port = free_port()
    command = [str(BIN / "uvicorn"), "app.main:app", "--host", "127.0.0.1", "--port", str(port)]
    env = {"KP_CACHE_CAPACITY": "50", "KP_CACHE_DB_PATH": str(tmp_path / "memory.db")}
    with serving(command, port, env) as client:
        trace = make_trace(trace_id="kp:trace:uvicorn", objective="Served by uvicorn")
        first = client.post("/evaluate", json=trace)
        assert first.status_code == 200, first.text
        assert first.json()["novelty"]["reason"] == "cache_empty"
        again = client.post("/evaluate", json=trace).json()
        assert again["novelty"]["measured"] is True
        assert again["novelty"]["max_cosine"] == pytest.approx(1.0, abs=1e-6)
        cache = client.get("/cache").json()
        assert (cache["capacity"], cache["size"]) == (50, 2)  # the settings came from KP_*


@pytest.mark.parametrize("server", ["fastapi", "gunicorn"])
def test_fastapi_run_and_gunicorn_serve_it_too(server: str) -> None:
    port = free_port()
    if server == "fastapi":
        command = [str(BIN / "fastapi"), "run", "app/main.py", "--port", str(port)]
        command += ["--host", "127.0.0.1"]
    else:
        command = [str(BIN / "gunicorn"), "app.main:app", "--bind", f"127.0.0.1:{port}"]
        command += ["--workers", "1", "--worker-class", "uvicorn_worker.UvicornWorker"]
    with serving(command, port, {"KP_EMBEDDER": "none", "KP_CACHE_DB_PATH": ":memory:"}) as client:
        answer = client.post("/evaluate", json=make_trace())
        assert answer.status_code == 200, answer.text
        assert answer.json()["score"] == 0.57625
        refused = client.post("/evaluate", json={**make_trace(), "steps": []})
        assert refused.status_code == 422
