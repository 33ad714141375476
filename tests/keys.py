"""API keys files for the trust tests: keys in clear for the client side, their SHA-256 in the
file as an operator writes it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.server import LiveServer

AGENT_A = "kp-agent-a-7c1f0e9b2d"
AGENT_B = "kp-agent-b-51d3aa04e6"
OPS = "kp-ops-0f8e62b1c9"
SLOW = "kp-slow-3b9d1e7a40"


def sha256(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def entry(name: str, key: str, scopes: list[str], rate: int | None = None) -> dict[str, Any]:
    e: dict[str, Any] = {"name": name, "sha256": sha256(key), "scopes": scopes}
    if rate is not None:
        e["rate_per_minute"] = rate
    return e


def write_keys(path: Path, entries: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps({"keys": entries}), encoding="utf-8")
    return path


def standard_keys(path: Path) -> Path:
    """agent-a and agent-b score, ops manages the cache, slow scores one request a minute."""
    return write_keys(
        path,
        [
            entry("agent-a", AGENT_A, ["evaluate"]),
            entry("agent-b", AGENT_B, ["evaluate"], rate=1000),
            entry("ops", OPS, ["admin"]),
            entry("slow", SLOW, ["evaluate"], rate=1),
        ],
    )


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def keyed_env(keys: Path, **more: str) -> dict[str, str]:
    """A preloaded one-thread service that reads its keys from `keys`."""
    return {
        "KP_EMBEDDER": "onnx",
        "KP_EMBEDDER_PRELOAD": "true",
        "KP_EMBEDDER_WORKERS": "1",
        "KP_EMBEDDER_THREADS": "1",
        "KP_LOG_LEVEL": "warning",
        "KP_API_KEYS_FILE": str(keys),
        **more,
    }


def adds(server: LiveServer) -> int:
    """The memory's running count of added vectors, read with the admin key."""
    r = server.client.get("/cache", headers=bearer(OPS))
    assert r.status_code == 200, r.text
    n: int = r.json()["adds_total"]
    return n
