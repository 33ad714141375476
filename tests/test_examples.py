"""Every example of README.md and docs/ runs, and prints what the page shows.

One live server with default settings (the model included) serves every page, and the pages
run in the order a reader meets them (README.md, then the site's nav), their blocks in order,
the memory never emptied between them: what a page shows is what a reader who followed the
pages before it gets. A page that wants another state says so and sets it. The convention
for marking blocks is in tests/doc_examples.py and docs/contributing.md.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

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
    shown_by_file,
    snippet_file,
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
    return [pytest.param(page, id=str(page.relative_to(ROOT))) for page in pages() if _marked(page)]


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


def _shown_outputs() -> list[tuple[str, str]]:
    """(where, text) of every output a page shows for a block that runs."""
    found = []
    for page in pages():
        for block in _marked(page):
            if block.option("file"):
                found.append((block.where, shown_by_file(snippet_file(block))))
            elif block.language == "console":
                found += [(block.where, out) for _, out in console_commands(block.text)]
            elif block.output is not None:
                found.append((block.where, block.output.text))
    return found


#: A float past 6 decimal places, or in exponent form: the last bits of one CPU's arithmetic.
_PAST_THE_PROMISE = re.compile(r"(?<![\w.])\d+\.\d{7,}|\b\d(?:\.\d+)?e-\d+\b")


def test_no_page_shows_a_float_past_the_promised_places_or_a_python_none() -> None:
    """Answers give scores and cosines to 6 places (docs/scoring.md): an output showing more
    is one CPU's, which another does not print; and a message is never Python's None."""
    past = [(where, m) for where, text in _shown_outputs() for m in _PAST_THE_PROMISE.findall(text)]
    assert not past, past
    nones = [where for where, text in _shown_outputs() if re.search(r"\bNone\b", text)]
    assert not nones, nones


@pytest.fixture(scope="module")
def data_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The user's data directory of the examples and of their server: a scratch one, so that
    neither meets the memory of the user's own service."""
    return tmp_path_factory.mktemp("data-home")


@pytest.fixture(scope="module")
def live(data_home: Path) -> Iterator[Server]:
    # Default settings: the model, no admin token, the default log level, the memory kept in
    # the default file (of a scratch data directory).
    with running_server(
        embedder="onnx", token=None, log_level="info", cache_db_path="", xdg_data_home=data_home
    ) as server:
        yield server


def _environment(url: str, data_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KP_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["KP_URL"] = url
    env["PYTHONUNBUFFERED"] = "1"
    env["XDG_DATA_HOME"] = str(data_home)
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
    if block.option("file"):
        return _run_file(snippet_file(block), url, env)
    code = on_live(block.text, url)
    if block.language == "python":
        command = [sys.executable, "-c", code]
    elif block.language == "js":
        command = _node_command(code, "doc-example.mjs")
    else:
        command = ["bash", "-c", code]
    returncode, stdout, stderr = _run(command, ROOT, env)
    if block.output is None:
        return [] if returncode == 0 else [f"exit {returncode}:\n{stdout}{stderr}"]
    got = as_shown(stdout + (stderr if returncode else ""), url)
    return differences(got, block.output.text)


def _node_command(code: str, name: str) -> list[str]:
    from tests.typescript import PACKAGE, build

    build()
    # Inside the package, so that "@kp-scoring/client" resolves to it (a self-reference).
    script = PACKAGE / "dist" / name
    script.write_text(code, encoding="utf-8")
    node = shutil.which("node")
    assert node is not None, "node 20+ is needed"
    return [node, str(script)]


def _run_file(path: Path, url: str, env: dict[str, str]) -> list[str]:
    """An example file, run as a user runs it (KP_URL set), and its output compared as it is:
    byte for byte, no normalisation but the server's address."""
    code = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        command = [sys.executable, str(path)]
    elif path.suffix == ".mjs":
        command = _node_command(code, f"example-{path.name}")
    elif path.suffix == ".sh":
        command = ["bash", str(path)]
    else:
        return [f"{path.name}: no way to run a {path.suffix} file"]
    returncode, stdout, stderr = _run(command, ROOT, env)
    if returncode != 0 and path.suffix != ".sh":
        return [f"{path.name}: exit {returncode}:\n{stdout}{stderr}"]
    shown = shown_by_file(path)
    got = as_shown(stdout, url)
    return [] if got == shown else [f"{path.name} printed:\n{got}\nwhere it shows:\n{shown}"]


@pytest.fixture(scope="module")
def reading(live: Server, data_home: Path) -> dict[Path, list[str]]:
    """Every page's examples, run once in reading order: each page's problems."""
    env = _environment(live.url, data_home)
    problems: dict[Path, list[str]] = {}
    for page in pages():
        problems[page] = []
        for block in _marked(page):
            required = block.option("requires")
            if required and importlib.util.find_spec(required) is None:
                warnings.warn(f"{block.where} not run: {required} is not installed", stacklevel=1)
                continue
            if block.language == "console" and not block.option("file"):
                found = _run_console(block, live.url, env)
            else:
                found = _run_script(block, live.url, env)
            problems[page] += [f"{block.where}: {p}" for p in found]
    return problems


@pytest.mark.parametrize("page", _params())
def test_the_examples_of_a_page_run_as_shown(page: Path, reading: dict[Path, list[str]]) -> None:
    assert not reading[page], "\n\n".join(reading[page])
