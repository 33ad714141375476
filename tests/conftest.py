"""Shared fixtures: apps built from explicit settings, the real embedder, reference fixtures."""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.core.config import MEMORY_ONLY, Settings
from app.embedding import model_files
from app.embedding.embeddings import EmbeddingService
from app.embedding.int8_support import CpuFeatures
from app.embedding.onnx_embedder import OnnxEmbedder
from app.embedding.types import Embedding
from app.main import create_app
from tests.keys import standard_keys
from tests.server import RedisServer, Server, running_server

FIXTURES = Path(__file__).parent / "fixtures"

ClientFactory = Callable[..., TestClient]

#: Fixtures that start a process; a test that uses one gets its marker (make test-fast).
_MARKED_FIXTURES = {
    "server": "server",
    "onnx_server": "server",
    "live": "server",
    "keyed": "server",
    "redis_server": "redis",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for name in getattr(item, "fixturenames", ()):
            marker = _MARKED_FIXTURES.get(name)
            if marker is not None:
                item.add_marker(marker)


def load_fixture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / "reference" / name).read_text(encoding="utf-8"))
    return data


@pytest.fixture(autouse=True, scope="session")
def _no_kp_settings_from_the_shell() -> Iterator[None]:
    """Tests state their settings (Settings reads KP_* too): the caller's shell stays out,
    for every fixture of every scope (this one is set up first). The memory lives in the
    process unless a test gives it a file: apps built side by side (pytest-xdist) must not
    share the default database in the user's data directory."""
    with pytest.MonkeyPatch.context() as env:
        for name in [n for n in os.environ if n.startswith("KP_")]:
            env.delenv(name)
        env.setenv("KP_CACHE_DB_PATH", MEMORY_ONLY)
        yield


@pytest.fixture
def make_client() -> Iterator[ClientFactory]:
    """Builds a started app (lifespan run) from settings given as keyword arguments, and
    `cpu`, the CPU int8 mode decides on (default: this machine's)."""
    clients: list[TestClient] = []

    def factory(cpu: CpuFeatures | None = None, **settings: Any) -> TestClient:
        app = create_app(Settings(**settings), cpu=cpu)
        client = TestClient(app, raise_server_exceptions=False)
        client.__enter__()
        clients.append(client)
        return client

    yield factory
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def client(make_client: ClientFactory) -> TestClient:
    """The service as it starts with no configuration: the real int8 MiniLM, loaded lazily."""
    return make_client()


@pytest.fixture
def client_no_embedder(make_client: ClientFactory) -> TestClient:
    return make_client(embedder="none")


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """A live server with no embedder (deterministic scores) and an admin token."""
    with running_server() as s:
        yield s


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A live server with no embedder whose API keys are tests/keys.py's standard ones."""
    keys = standard_keys(tmp_path_factory.mktemp("keys") / "keys.json")
    with running_server(api_keys_file=str(keys)) as server:
        yield server


@pytest.fixture(scope="module")
def onnx_server() -> Iterator[Server]:
    """A live server with the real embedder, so that the cache fills and novelty is measured."""
    with running_server(embedder="onnx") as s:
        yield s


def fail_embedding_on(
    monkeypatch: pytest.MonkeyPatch, embeddings: EmbeddingService, marker: str
) -> None:
    """Fault injection: the model run raises whenever one of its texts contains `marker`."""
    real = embeddings.scheduler.backend

    def fragile(texts: list[str], one_core: bool = False) -> list[Embedding]:
        if any(marker in t for t in texts):
            raise RuntimeError("simulated onnxruntime failure")
        return real(texts, one_core)

    monkeypatch.setattr(embeddings.scheduler, "backend", fragile)


@pytest.fixture(scope="session")
def embedder() -> OnnxEmbedder:
    files = model_files.resolve(None, None)
    model_files.verify(files)
    return OnnxEmbedder(files.model, files.tokenizer)


def hold_runs(monkeypatch: pytest.MonkeyPatch, embeddings: EmbeddingService) -> threading.Event:
    """Model runs wait for the returned event before they run (the real model): a test can
    hold a run in progress, queue requests behind it, and let it go when it chooses, with no
    assumption about how fast this machine is."""
    gate = threading.Event()
    real = embeddings.scheduler.backend

    def held(texts: list[str], one_core: bool = False) -> list[Embedding]:
        gate.wait()
        return real(texts, one_core)

    monkeypatch.setattr(embeddings.scheduler, "backend", held)
    return gate


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for the session (AOF on, a password); tests keep apart by prefix."""
    server = RedisServer(tmp_path_factory.mktemp("redis"), password="s3cret-redis-pw")
    yield server
    server.stop()


@pytest.fixture
def redis_prefix() -> str:
    return f"kp-test-{uuid.uuid4().hex[:8]}:"
