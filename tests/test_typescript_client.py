"""The TypeScript client (clients/typescript) and the official TypeScript MCP client, run by
node against live servers (the node:test suites in clients/typescript/test/): one open, one
with an API keys file."""

from __future__ import annotations

import os
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
    assert "# pass 16" in ran.stdout
