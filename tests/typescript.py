"""The TypeScript client's package (clients/typescript): npm, and its build."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "clients" / "typescript"


def npm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    found = shutil.which("npm")
    if found is None:
        raise RuntimeError("node 20 and npm are needed for the TypeScript client's tests")
    return subprocess.run(
        [found, *args], cwd=PACKAGE, env=env, capture_output=True, text=True, timeout=600
    )


def build() -> None:
    """`npm ci` when the pinned packages are not installed yet (make test runs it anyway),
    then the build: the types from openapi/openapi.json, then tsc. Once a test run: the
    sources do not change while the tests run, and a build takes seconds."""
    if _built:
        return
    if not (PACKAGE / "node_modules").is_dir():
        installed = npm("ci", "--no-audit", "--no-fund")
        assert installed.returncode == 0, installed.stderr[-4000:]
    built = npm("run", "build")
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    _built.append(True)


_built: list[bool] = []
