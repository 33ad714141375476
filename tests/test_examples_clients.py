"""The clients' examples (examples/, shown in docs/clients.md) run as they stand against a
live service with default settings (the model loaded, no key, an empty memory: every example
is a dry run), and print what the files say they print: the `# ` (or `// `) lines at the end
of a script, or the .out file beside a shell example."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server import ROOT, LiveServer
from tests.typescript import PACKAGE, build

pytestmark = [pytest.mark.server]

EXAMPLES = ROOT / "examples"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = LiveServer({}, tmp_path_factory.mktemp("examples") / "server.log")
    yield server
    server.stop()


def shown(path: Path, prefix: str) -> list[str]:
    """The output a script says it prints: its last comment lines."""
    lines = path.read_text(encoding="utf-8").splitlines()
    tail: list[str] = []
    for line in reversed(lines):
        if not line.startswith(prefix):
            break
        tail.insert(0, line.removeprefix(prefix))
    assert tail, f"{path.name} shows no output"
    return tail


def run(command: list[str], url: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KP_")}
    env |= {"KP_URL": url}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.parametrize("name", ["client.py", "client_async.py", "mcp_client.py"])
def test_a_python_example(live: LiveServer, name: str) -> None:
    ran = run([sys.executable, str(EXAMPLES / name)], live.url)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == shown(EXAMPLES / name, "# ")


def test_the_command_line_example(live: LiveServer) -> None:
    bash = shutil.which("bash")
    assert bash is not None
    ran = run([bash, str(EXAMPLES / "cli.sh")], live.url)
    assert ran.returncode == 0, ran.stderr
    # Byte for byte: a pipe gets no wrapping and no padding, whatever COLUMNS says.
    assert ran.stdout == (EXAMPLES / "cli.out").read_text(encoding="utf-8")


@pytest.mark.slow  # npm ci, tsc
def test_the_typescript_example(live: LiveServer) -> None:
    build()
    # Inside the package, so that "@kp-scoring/client" resolves to it (a self-reference).
    script = PACKAGE / "dist" / "example-client.mjs"
    shutil.copyfile(EXAMPLES / "client.mjs", script)
    node = shutil.which("node")
    assert node is not None
    ran = run([node, str(script)], live.url)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == shown(EXAMPLES / "client.mjs", "// ")
