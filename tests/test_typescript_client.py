"""The TypeScript client (clients/typescript) and the official TypeScript MCP client, run by
node against a live server (the node:test suites in clients/typescript/test/)."""

from __future__ import annotations

import os

import pytest

from tests.server import TOKEN, running_server
from tests.typescript import build, npm

pytestmark = [pytest.mark.server, pytest.mark.slow]  # npm ci, tsc, node


def test_the_typescript_clients_against_a_live_server() -> None:
    build()
    with running_server() as server:
        env = {**os.environ, "KP_URL": server.url, "KP_TEST_ADMIN_TOKEN": TOKEN}
        ran = npm("test", env=env)
    assert ran.returncode == 0, ran.stdout[-8000:] + ran.stderr[-2000:]
    assert "# fail 0" in ran.stdout
    assert "# pass 12" in ran.stdout
