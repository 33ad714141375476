"""What the in-process memory's journal costs (docs/operating/persistence.md): a committed
POST /evaluate and a 30,000-line POST /cache/import, with KP_CACHE_JOURNAL_FSYNC off, everysec
and always, measured side by side (three servers, taking turns) so that a busy host slows all
of them alike.

    python -m bench.journal [--requests 200] [--imports 3] [--lines 30000]

Each server runs the real model (preloaded, one thread) with a snapshot path in a temporary
directory, no periodic save during the run and the exact search (no index builds in the
background), and the modes take turns in a rotating order.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.server import ADMIN_TOKEN, HOST, Server
from bench.stats import percentile
from tests.factories import import_body

MODES = ("off", "everysec", "always")


class _Server:
    """A service with the journal in `mode` (bench.server.Server), and a client for it."""

    def __init__(self, mode: str, directory: Path) -> None:
        settings = {
            "KP_CACHE_SNAPSHOT_PATH": str(directory / f"{mode}.snapshot"),
            "KP_CACHE_SNAPSHOT_INTERVAL_S": "86400",
            "KP_CACHE_JOURNAL_FSYNC": mode,
            "KP_CACHE_CAPACITY": "100000",
            # No index builds in the background: they would run while another server is
            # measured (the journal's cost does not depend on the search).
            "KP_CACHE_SEARCH": "exact",
            "KP_EMBEDDER_PRELOAD": "true",
            "KP_EMBEDDER_THREADS": "1",
            "KP_EMBEDDER_WORKERS": "1",
            "KP_EMBED_MEMO_CAPACITY": "0",
            "KP_LOG_LEVEL": "warning",
        }
        self.server = Server(settings, directory / f"{mode}.log", timeout_s=120)
        self.client = httpx.Client(
            base_url=f"http://{HOST}:{self.server.port}",
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=120,
        )

    def stop(self) -> None:
        self.client.close()
        self.server.stop()


def _trace(i: int) -> dict[str, Any]:
    objective = f"Reconcile ledger batch {i} {uuid.uuid4().hex} against the bank statements"
    return {
        "@context": "https://openknowledgepulse.org/schema/v1",
        "@type": "ReasoningTrace",
        "id": f"kp:trace:bench-{i}",
        "metadata": {
            "created_at": "2025-06-15T10:00:00.000Z",
            "task_domain": "finance",
            "success": True,
            "quality_score": 0.5,
            "visibility": "network",
            "privacy_level": "aggregated",
        },
        "task": {"objective": objective},
        "steps": [
            {"step_id": 0, "type": "thought", "content": "Match totals line by line"},
            {"step_id": 1, "type": "tool_call", "tool": {"name": "sql"}, "content": "query"},
        ],
        "outcome": {"result_summary": "Reconciled", "confidence": 0.9},
    }


def _turn(i: int) -> tuple[str, ...]:
    k = i % len(MODES)
    return MODES[k:] + MODES[:k]


def run(requests: int, imports: int, lines: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        servers = {mode: _Server(mode, Path(tmp)) for mode in MODES}
        try:
            request_ms: dict[str, list[float]] = {m: [] for m in MODES}
            for i in range(requests):  # A B C, B C A, C A B, ...: no mode always first
                for mode in _turn(i):
                    server = servers[mode]
                    started = time.perf_counter()
                    r = server.client.post("/evaluate", json=_trace(i))
                    request_ms[mode].append((time.perf_counter() - started) * 1000)
                    r.raise_for_status()
            import_ms: dict[str, list[float]] = {m: [] for m in MODES}
            for round_ in range(imports):
                body = import_body(lines, seed=round_, id_prefix=f"kp:trace:import-{round_}-")
                for mode in _turn(round_):
                    server = servers[mode]
                    started = time.perf_counter()
                    r = server.client.post(
                        "/cache/import",
                        content=body,
                        headers={"content-type": "application/x-ndjson"},
                    )
                    import_ms[mode].append((time.perf_counter() - started) * 1000)
                    r.raise_for_status()
        finally:
            for server in servers.values():
                server.stop()
    return {
        "requests": {
            mode: {
                "p50_ms": round(percentile(ms, 50), 3),
                "p99_ms": round(percentile(ms, 99), 3),
                "p50_vs_off": round(percentile(ms, 50) / percentile(request_ms["off"], 50), 3),
            }
            for mode, ms in request_ms.items()
        },
        "imports": {
            mode: {
                "median_ms": round(float(np.median(ms)), 1),
                "vs_off": round(float(np.median(ms)) / float(np.median(import_ms["off"])), 3),
            }
            for mode, ms in import_ms.items()
        },
        "lines": lines,
        "cpu": _cpu(),
    }


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench journal", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--imports", type=int, default=3)
    parser.add_argument("--lines", type=int, default=30_000)
    args = parser.parse_args(argv)
    print(json.dumps(run(args.requests, args.imports, args.lines), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
