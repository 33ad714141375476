"""A new replica against a Redis that already holds a large shared memory, and a restart
from a large snapshot (issue 19).

    python -m bench.replica [--size 1000000] [--build-too] [--out bench/results/replica.json]

Shared: a redis-server of its own (AOF, appendfsync everysec) is filled through a first
service's `POST /cache/import` with the memory phase's vectors (bench/memory.py: the real
MiniLM vectors, then derived ones past them), in requests of IMPORT_CHUNK entries. That
service builds the graph of its mirror and publishes it in Redis (KP_CACHE_INDEX_SHARE);
once it has, it stops. Redis's `used_memory` over the entries is the cost per entry, the
published graph's chunks part of it. Then a replica with the same settings starts against
it: seconds from its spawn to /healthz, and to /readyz "ready" (its mirror loaded from the log
and the published graph adopted), with what /readyz showed on the way. With --build-too, one
more replica with KP_CACHE_INDEX_SHARE=false builds its own graph (the time without sharing).
One dry-run POST /evaluate checks that a replica measures novelty against the whole memory
and names a stored trace.

In process: a service with KP_CACHE_SNAPSHOT_PATH is filled the same way, builds its graph
(saved beside the snapshot), and stops (saving the snapshot); a new one restores both:
seconds to /healthz and to ready.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from redis import Redis

from app.domain.vector_cache import CacheEntries
from app.services.cache_transfer import export_lines
from bench import corpus, memory, memory_corpus
from bench.server import ADMIN_TOKEN, ROOT, Server, rss_mb
from bench.shared import redis_server

#: Entries per import request: about 43 MB of NDJSON, under the default 64 MiB limit.
IMPORT_CHUNK = 20_000
DEFAULT_OUT = ROOT / "bench" / "results" / "replica.json"


def stored_vectors(size: int) -> np.ndarray[Any, np.dtype[np.float32]]:
    _, vectors = memory_corpus.available(memory.REAL_VECTORS)
    if not len(vectors):
        _, vectors = memory_corpus.vectors(memory.REAL_VECTORS)
    return memory.memory_of(vectors, size)


def fill(url: str, stored: np.ndarray[Any, np.dtype[np.float32]]) -> float:
    """Imports every vector, oldest first, through the service at `url`; seconds taken."""
    n = len(stored)
    now = time.time() * 1000
    times = (now - 60_000.0 + np.arange(n) * (60_000.0 / n)).astype(np.float64)
    started = time.perf_counter()
    admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    with httpx.Client(base_url=url, timeout=600, headers=admin) as client:
        for start in range(0, n, IMPORT_CHUNK):
            stop = min(n, start + IMPORT_CHUNK)
            ids = [f"kp:trace:{i}" for i in range(start, stop)]
            body = b"".join(
                export_lines([CacheEntries(stored[start:stop], times[start:stop], ids)])
            )
            r = client.post(
                "/cache/import", content=body, headers={"content-type": "application/x-ndjson"}
            )
            if r.status_code != 200:  # the service's reason, for the report
                raise RuntimeError(
                    f"POST /cache/import of entries {start}..{stop - 1}: {r.status_code} {r.text}"
                )
    return time.perf_counter() - started


#: The bench's servers use the default KP_REDIS_PREFIX.
GRAPH_KEY = "kp:novelty:graph"


def until_ready(url: str, started: float) -> tuple[float, dict[str, Any], list[dict[str, Any]]]:
    """Polls /readyz until ready: (seconds since `started`, the ready answer, a sample of
    what it showed on the way: the first, some middle ones, the last)."""
    seen: list[dict[str, Any]] = []
    with httpx.Client(base_url=url, timeout=60) as c:
        while True:
            ready = c.get("/readyz").json()
            if ready["status"] == "ready":
                way = seen[:1] + seen[1:-1][:: max(1, len(seen) // 8)] + seen[-1:]
                return time.perf_counter() - started, ready, way
            seen.append(
                {
                    "s": round(time.perf_counter() - started, 1),
                    "status": ready["status"],
                    "warnings": ready.get("warnings"),
                    "cache_index": ready.get("cache_index"),
                }
            )
            time.sleep(0.5)


def check(url: str) -> dict[str, Any]:
    """One dry run: measured against the whole memory, naming a stored trace."""
    trace = corpus.build("typical", 1, seed=3)[0].trace
    with httpx.Client(base_url=url, timeout=60) as c:
        answer = c.post("/evaluate", params={"dry_run": "true"}, json=trace).json()
    return {
        "measured": answer["novelty"]["measured"],
        "cache_size": answer["novelty"]["cache_size"],
        "nearest": answer["novelty"]["nearest"],
    }


def new_replica(env: dict[str, str], log: Path) -> dict[str, Any]:
    """A service started on a memory that is already there: to /healthz, to ready."""
    started = time.perf_counter()
    server = Server(env, log, timeout_s=600)
    out: dict[str, Any] = {"to_healthz_s": round(time.perf_counter() - started, 2)}
    try:
        url = f"http://127.0.0.1:{server.port}"
        ready_s, ready, way = until_ready(url, started)
        index = ready.get("cache_index") or {}
        out |= {
            "to_ready_s": round(ready_s, 1),
            "index_builds": index.get("builds_total"),
            "index_adoptions": index.get("adoptions_total"),
            "rss_mb": round(rss_mb(server.pid)),
            "check": check(url),
            "readyz_on_the_way": way,
        }
    finally:
        server.stop()
    return out


def stop_gracefully(server: Server, timeout_s: float = 600) -> None:
    """SIGTERM and wait (a large snapshot takes a while to save), then clean up."""
    server.process.send_signal(signal.SIGTERM)
    server.process.wait(timeout_s)
    server.stop()


def shared(
    size: int, stored: np.ndarray[Any, np.dtype[np.float32]], workdir: Path, build_too: bool
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with redis_server("everysec") as redis:
        env = {
            "KP_REDIS_URL": redis.url,
            "KP_CACHE_CAPACITY": str(size),
            "KP_LOG_LEVEL": "info",
            "KP_CACHE_IMPORT_MAX_BYTES": str(64 << 20),
        }
        client = Redis.from_url(redis.url)
        with Server(env, workdir / "writer.log", timeout_s=600) as writer:
            out["import_s"] = round(fill(f"http://127.0.0.1:{writer.port}", stored), 1)
            started = time.perf_counter()
            until_ready(f"http://127.0.0.1:{writer.port}", started)
            while not client.exists(GRAPH_KEY):
                time.sleep(0.5)
            out["writer_graph_built_and_published_after_import_s"] = round(
                time.perf_counter() - started, 1
            )
        info = client.info("memory")
        about = {k.decode(): v.decode() for k, v in client.hgetall(GRAPH_KEY).items()}  # type: ignore[union-attr]
        graph_bytes = int(about["bytes"])
        out["redis_used_memory_mb"] = round(info["used_memory"] / 2**20, 1)
        out["redis_bytes_per_entry"] = round(info["used_memory"] / size)
        out["published_graph_entries"] = int(about["count"])
        out["published_graph_bytes_per_entry"] = round(graph_bytes / int(about["count"]))
        out["redis_log_bytes_per_entry"] = round((info["used_memory"] - graph_bytes) / size)
        out["replica_adopting"] = new_replica(env, workdir / "replica.log")
        if build_too:
            alone = env | {"KP_CACHE_INDEX_SHARE": "false"}
            out["replica_building"] = new_replica(alone, workdir / "replica-alone.log")
    return out


def restart(
    size: int, stored: np.ndarray[Any, np.dtype[np.float32]], workdir: Path
) -> dict[str, Any]:
    path = workdir / "cache.snapshot"
    env = {
        "KP_CACHE_CAPACITY": str(size),
        "KP_LOG_LEVEL": "info",
        "KP_CACHE_IMPORT_MAX_BYTES": str(64 << 20),
        "KP_CACHE_SNAPSHOT_PATH": str(path),
    }
    out: dict[str, Any] = {}
    first = Server(env, workdir / "first.log", timeout_s=600)
    try:
        url = f"http://127.0.0.1:{first.port}"
        out["import_s"] = round(fill(url, stored), 1)
        started = time.perf_counter()
        until_ready(url, started)
        while not (workdir / "cache.snapshot.graph.json").exists():
            time.sleep(0.5)
        out["graph_built_and_saved_after_import_s"] = round(time.perf_counter() - started, 1)
        started = time.perf_counter()
    finally:
        stop_gracefully(first)
    out["stop_with_snapshot_s"] = round(time.perf_counter() - started, 1)
    out["snapshot_mb"] = round(path.stat().st_size / 2**20)
    out["graph_file_mb"] = round((workdir / "cache.snapshot.graph").stat().st_size / 2**20)
    out["restarted"] = new_replica(env, workdir / "restarted.log")
    return out


def measure(size: int, workdir: Path, build_too: bool = False) -> dict[str, Any]:
    stored = stored_vectors(size)
    return {
        "entries": size,
        "cpu": "AMD EPYC, 2 cores, AVX-512 and VNNI; host shared with other work",
        "shared": shared(size, stored, workdir, build_too),
        "in_process_restart": restart(size, stored, workdir),
    }


def render(r: dict[str, Any]) -> str:
    s, p = r["shared"], r["in_process_restart"]
    a = s["replica_adopting"]
    lines = [
        f"at {r['entries']} entries, shared: import {s['import_s']} s, graph built and published "
        f"{s['writer_graph_built_and_published_after_import_s']} s later; Redis "
        f"{s['redis_used_memory_mb']} MB ({s['redis_log_bytes_per_entry']} B/entry of log, "
        f"{s['published_graph_bytes_per_entry']} B/entry of graph); new replica to /healthz "
        f"{a['to_healthz_s']} s, to ready {a['to_ready_s']} s (adopted {a['index_adoptions']}, "
        f"built {a['index_builds']}), RSS {a['rss_mb']} MB, first answer against "
        f"{a['check']['cache_size']} entries",
    ]
    if "replica_building" in s:
        b = s["replica_building"]
        lines.append(f"  without sharing: to ready {b['to_ready_s']} s (built {b['index_builds']})")
    rp = p["restarted"]
    lines.append(
        f"in process: import {p['import_s']} s, graph saved {p['graph_built_and_saved_after_import_s']}"
        f" s later, stop {p['stop_with_snapshot_s']} s ({p['snapshot_mb']} MB + "
        f"graph {p['graph_file_mb']} MB); restart to /healthz {rp['to_healthz_s']} s, to ready "
        f"{rp['to_ready_s']} s (adopted {rp['index_adoptions']}, built {rp['index_builds']}), "
        f"first answer against {rp['check']['cache_size']} entries"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replica", description=__doc__)
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument(
        "--build-too",
        action="store_true",
        help="also start a replica that builds its own graph (KP_CACHE_INDEX_SHARE=false)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kp-bench-replica-") as tmp:
        result = measure(args.size, Path(tmp), args.build_too)
    result["command"] = " ".join(["python -m bench.replica", *(argv or sys.argv[1:])])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(render(result))
    print(
        json.dumps(result["shared"]["replica_adopting"]["readyz_on_the_way"], indent=1),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
