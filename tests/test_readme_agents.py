"""README "For agents": the REST, MCP and TypeScript examples, run as they stand in the README
against a live server (embedder off: the example trace scores 0.57625)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from tests.server import ROOT, Server, running_server
from tests.test_readme import README, blocks
from tests.typescript import PACKAGE, build

DEFAULT_URL = "http://127.0.0.1:8000"


def agents_section() -> str:
    start = README.index("## For agents")
    return README[start : README.index("\n## ", start + 1)]


def only_block(language: str) -> str:
    section = agents_section()
    (block,) = [b for b in blocks(language) if b in section]
    assert DEFAULT_URL in block
    return block


@pytest.fixture(scope="module")
def live() -> Iterator[Server]:
    with running_server() as server:
        yield server


def test_the_rest_example(live: Server) -> None:
    script = only_block("bash").replace(DEFAULT_URL, live.url)
    bash = shutil.which("bash")
    assert bash is not None
    ran = subprocess.run([bash, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    answer = json.loads(ran.stdout)
    assert answer["score"] == 0.57625
    assert answer["trace_id"] == "kp:trace:550e8400-e29b-41d4-a716-446655440000"


def test_the_mcp_example(live: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    code = only_block("python")
    shown = [line.removeprefix("# ") for line in code.splitlines() if line.startswith("# ")]
    monkeypatch.chdir(ROOT)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code.replace(DEFAULT_URL, live.url), "README.md", "exec"), {})
    assert out.getvalue().splitlines() == shown


@pytest.mark.slow  # npm ci, tsc
def test_the_typescript_example(live: Server) -> None:
    build()
    code = only_block("js")
    shown = [line.removeprefix("// ") for line in code.splitlines() if line.startswith("// ")]
    # Inside the package, so that "@kp-scoring/client" resolves to it (a self-reference).
    script = PACKAGE / "dist" / "readme-example.mjs"
    script.write_text(code.replace(DEFAULT_URL, live.url), encoding="utf-8")
    node = shutil.which("node")
    assert node is not None
    ran = subprocess.run([node, str(script)], cwd=ROOT, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == shown
