"""The TypeScript client (clients/typescript) and the official TypeScript MCP client, run by
node against a live server: `npm ci` (when node_modules is missing), build, `npm test`."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tests.server import TOKEN, running_server

PACKAGE = Path(__file__).resolve().parents[1] / "clients" / "typescript"


def npm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("node 20 and npm are needed for the TypeScript client's tests")
    return subprocess.run(
        [npm, *args], cwd=PACKAGE, env=env, capture_output=True, text=True, timeout=600
    )


def build() -> None:
    if not (PACKAGE / "node_modules").is_dir():
        installed = npm("ci", "--no-audit", "--no-fund")
        assert installed.returncode == 0, installed.stderr[-4000:]
    built = npm("run", "build")
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]


def test_the_typescript_clients_against_a_live_server() -> None:
    build()
    with running_server() as server:
        env = {**os.environ, "KP_URL": server.url, "KP_TEST_ADMIN_TOKEN": TOKEN}
        ran = npm("test", env=env)
    assert ran.returncode == 0, ran.stdout[-8000:] + ran.stderr[-2000:]
    assert "# fail 0" in ran.stdout
    assert "# pass 12" in ran.stdout
