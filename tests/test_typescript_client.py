"""The TypeScript client (clients/typescript) and the official TypeScript MCP client, run by
node against live servers (the node:test suites in clients/typescript/test/): one open, one
with an API keys file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.keys import AGENT_A, OPS, standard_keys
from tests.server import TOKEN, running_server
from tests.typescript import build, npm

pytestmark = [pytest.mark.server, pytest.mark.slow]  # npm ci, tsc, node


def test_the_typescript_clients_against_live_servers(tmp_path: Path) -> None:
    build()
    keys = standard_keys(tmp_path / "keys.json")
    with running_server() as server, running_server(api_keys_file=str(keys)) as keyed:
        env = {
            **os.environ,
            "KP_URL": server.url,
            "KP_TEST_ADMIN_TOKEN": TOKEN,
            "KP_KEYED_URL": keyed.url,
            "KP_TEST_EVALUATE_KEY": AGENT_A,
            "KP_TEST_ADMIN_KEY": OPS,
        }
        ran = npm("test", env=env)
    assert ran.returncode == 0, ran.stdout[-8000:] + ran.stderr[-2000:]
    assert "# fail 0" in ran.stdout
    assert "# pass 18" in ran.stdout


def test_the_package_file_is_a_copy_that_installs_into_a_project(tmp_path: Path) -> None:
    """docs/clients.md: `npm pack`, then `npm install` of the package file. Unlike installing
    the folder (npm links a local folder), the project holds a copy: it keeps working when the
    clone moves. The package holds the built client and no test, source map of tests or
    node_modules."""
    build()
    packed = npm("pack", "--json", "--pack-destination", str(tmp_path))
    assert packed.returncode == 0, packed.stderr
    (found,) = json.loads(packed.stdout)
    files = {f["path"] for f in found["files"]}
    assert "package.json" in files
    assert "dist/src/index.js" in files
    assert "dist/src/index.d.ts" in files
    assert not {f for f in files if f.startswith(("dist/test", "node_modules", "src/"))}
    project = tmp_path / "project"
    project.mkdir()
    (project / "package.json").write_text('{"name": "a-project", "private": true}')
    npm_path = shutil.which("npm")
    assert npm_path is not None
    installed = subprocess.run(
        [
            npm_path,
            "install",
            "--offline",
            "--no-audit",
            "--no-fund",
            str(tmp_path / found["filename"]),
        ],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert installed.returncode == 0, installed.stderr
    where = project / "node_modules" / "@kp-scoring" / "client"
    assert where.is_dir()
    assert not where.is_symlink()  # a copy, not a link into the clone
    node = shutil.which("node")
    assert node is not None
    imported = subprocess.run(
        [
            node,
            "-e",
            'import("@kp-scoring/client").then(m => console.log(typeof m.KpScoringClient))',
        ],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert imported.stdout.strip() == "function", imported.stderr
