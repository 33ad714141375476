"""Every example of README.md and docs/ runs, and prints what the page shows.

One live server with default settings (the model included) serves every page; its memory is
emptied before each page, whose blocks run in order (a page's second request may see its
first). The convention for marking blocks is in tests/doc_examples.py and
docs/contributing.md.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.doc_examples import (
    ROOT,
    RUN_LANGUAGES,
    Block,
    as_shown,
    blocks,
    console_commands,
    differences,
    on_live,
    pages,
)
from tests.server import Server, running_server

SEPARATOR = "@@kp-doc-example@@"
#: Longest a block may run; then it and everything it started are killed.
TIMEOUT_S = 120


def _run(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str, str]:
    """Run in a process group of its own, killed whole if it outlives TIMEOUT_S."""
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"ran past {TIMEOUT_S} s: {command}\n{out}{err}")
    return process.returncode, out, err


def _marked(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.mark == "run"]


def _params() -> list[object]:
    params: list[object] = []
    for page in pages():
        runnable = _marked(page)
        if not runnable:
            continue
        marks = (
            [pytest.mark.slow]
            if any(b.option("slow") or b.option("node") for b in runnable)
            else []
        )
        params.append(pytest.param(page, id=str(page.relative_to(ROOT)), marks=marks))
    return params


def test_every_block_that_a_user_types_is_marked() -> None:
    unmarked = [
        b.where
        for page in pages()
        for b in blocks(page)
        if b.language in RUN_LANGUAGES and b.mark not in ("run", "not run")
    ]
    assert not unmarked, f"mark these <!-- run --> or <!-- not run: why -->: {unmarked}"


def test_the_readme_and_the_getting_started_page_have_examples_that_run() -> None:
    for page in ("README.md", "docs/getting-started.md", "docs/api.md", "docs/scoring.md"):
        assert _marked(ROOT / page), page


@pytest.fixture(scope="module")
def live() -> Iterator[Server]:
    # Default settings: the model, no admin token, the default log level.
    with running_server(embedder="onnx", token=None, log_level="info") as server:
        yield server


def _environment(url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KP_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["KP_URL"] = url
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run_console(block: Block, url: str, env: dict[str, str]) -> list[str]:
    pairs = console_commands(block.text)
    script = "".join(
        f"{on_live(command, url)}\n__rc=$?; printf '\\n{SEPARATOR}\\n'; (exit $__rc)\n"
        for command, _ in pairs
    )
    _, stdout, _ = _run(["bash", "-c", f"exec 2>&1\n{script}"], ROOT, env)
    outputs = stdout.split(f"\n{SEPARATOR}\n")
    problems = []
    for i, (command, shown) in enumerate(pairs):
        got = as_shown(outputs[i] if i < len(outputs) else "", url)
        problems += [f"$ {command}\n{p}" for p in differences(got, shown)]
    return problems


def _run_script(block: Block, url: str, env: dict[str, str]) -> list[str]:
    code = on_live(block.text, url)
    if block.language == "python":
        command = [sys.executable, "-c", code]
    elif block.language == "js":
        from tests.typescript import PACKAGE, build

        build()
        # Inside the package, so that "@kp-scoring/client" resolves to it (a self-reference).
        script = PACKAGE / "dist" / "doc-example.mjs"
        script.write_text(code, encoding="utf-8")
        node = shutil.which("node")
        assert node is not None, "node 20+ is needed"
        command = [node, str(script)]
    else:
        command = ["bash", "-c", code]
    returncode, stdout, stderr = _run(command, ROOT, env)
    if block.output is None:
        return [] if returncode == 0 else [f"exit {returncode}:\n{stdout}{stderr}"]
    got = as_shown(stdout + (stderr if returncode else ""), url)
    return differences(got, block.output.text)


@pytest.mark.parametrize("page", _params())
def test_the_examples_of_a_page_run_as_shown(page: Path, live: Server) -> None:
    httpx.delete(f"{live.url}/cache", timeout=30).raise_for_status()
    env = _environment(live.url)
    problems: list[str] = []
    for block in _marked(page):
        required = block.option("requires")
        if required and importlib.util.find_spec(required) is None:
            warnings.warn(f"{block.where} not run: {required} is not installed", stacklevel=1)
            continue
        if block.language == "console":
            found = _run_console(block, live.url, env)
        else:
            found = _run_script(block, live.url, env)
        problems += [f"{block.where}: {p}" for p in found]
    assert not problems, "\n\n".join(problems)
