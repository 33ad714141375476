"""One version for the project: clients/python/VERSION, read by both pyprojects, is what
`kp-scoring --version` prints, what the service says (/healthz, the OpenAPI document, MCP's
server info) and what the TypeScript client's package and the image's label carry."""

from __future__ import annotations

import json
import re
import subprocess

from fastapi.testclient import TestClient

from kp_scoring import __version__ as client_version
from tests.server import ROOT, entry_point

VERSION = (ROOT / "clients" / "python" / "VERSION").read_text(encoding="utf-8").strip()


def test_the_version_is_a_release_number() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION)


def test_the_command_prints_it() -> None:
    shown = subprocess.run(
        [entry_point(), "--version"], capture_output=True, text=True, check=True, timeout=30
    )
    assert shown.stdout == f"kp-scoring {VERSION}\n"
    assert client_version == VERSION


def test_the_service_says_it(client_no_embedder: TestClient) -> None:
    assert client_no_embedder.get("/healthz").json()["version"] == VERSION
    assert client_no_embedder.get("/openapi.json").json()["info"]["version"] == VERSION
    committed = json.loads((ROOT / "openapi" / "openapi.json").read_text(encoding="utf-8"))
    assert committed["info"]["version"] == VERSION


def test_the_typescript_client_and_the_image_carry_it() -> None:
    package = json.loads((ROOT / "clients/typescript/package.json").read_text(encoding="utf-8"))
    assert package["version"] == VERSION
    dockerfile = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    assert f"ARG VERSION={VERSION}\n" in dockerfile
