"""A new replica against a Redis that already holds a large shared memory (issue 19).

    python -m bench.replica [--size 1000000] [--out bench/results/replica.json]

A redis-server of its own (AOF, appendfsync everysec) is filled through a first service's
`POST /cache/import` with the memory phase's vectors (bench/memory.py: the real MiniLM vectors,
then derived ones past them), in requests of IMPORT_CHUNK entries. That service stops; Redis's
`used_memory` over the entries is the cost per entry. Then a replica with the same settings
starts against it: seconds from its spawn to /healthz, and to /readyz "ready" (its mirror
loaded from the log and, past KP_CACHE_INDEX_THRESHOLD, its index built), with what /readyz
showed on the way (the warming progress). Last, one dry-run POST /evaluate checks that the
replica measures novelty against the whole memory and names a stored trace.
"""

from __future__ import annotations

import argparse
import json
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
            r.raise_for_status()
    return time.perf_counter() - started


def measure(size: int, workdir: Path) -> dict[str, Any]:
    stored = stored_vectors(size)
    out: dict[str, Any] = {"entries": size}
    with redis_server("everysec") as redis:
        env = {
            "KP_REDIS_URL": redis.url,
            "KP_CACHE_CAPACITY": str(size),
            "KP_LOG_LEVEL": "warning",
            "KP_CACHE_IMPORT_MAX_BYTES": str(64 << 20),
        }
        with Server(env, workdir / "writer.log", timeout_s=600) as writer:
            out["import_s"] = round(fill(f"http://127.0.0.1:{writer.port}", stored), 1)
        del stored
        info = Redis.from_url(redis.url).info("memory")
        out["redis_used_memory_mb"] = round(info["used_memory"] / 2**20, 1)
        out["redis_bytes_per_entry"] = round(info["used_memory"] / size)

        started = time.perf_counter()
        replica = Server(env, workdir / "replica.log", timeout_s=600)
        out["replica_to_healthz_s"] = round(time.perf_counter() - started, 2)
        seen: list[dict[str, Any]] = []
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{replica.port}", timeout=60) as c:
                while True:
                    ready = c.get("/readyz").json()
                    if ready["status"] == "ready":
                        break
                    seen.append(
                        {
                            "s": round(time.perf_counter() - started, 1),
                            "status": ready["status"],
                            "warnings": ready.get("warnings"),
                            "cache_index": ready.get("cache_index"),
                        }
                    )
                    time.sleep(0.5)
                out["replica_to_ready_s"] = round(time.perf_counter() - started, 1)
                out["replica_rss_mb"] = round(rss_mb(replica.pid))
                trace = corpus.build("typical", 1, seed=3)[0].trace
                answer = c.post("/evaluate", params={"dry_run": "true"}, json=trace).json()
                out["check"] = {
                    "measured": answer["novelty"]["measured"],
                    "cache_size": answer["novelty"]["cache_size"],
                    "nearest": answer["novelty"]["nearest"],
                }
        finally:
            replica.stop()
        # A sample of the way, not every poll: the first, some middle ones, the last.
        out["readyz_on_the_way"] = seen[:1] + seen[1:-1][:: max(1, len(seen) // 8)] + seen[-1:]
    return out


def render(r: dict[str, Any]) -> str:
    return (
        f"replica at {r['entries']} entries: import {r['import_s']} s; Redis "
        f"{r['redis_used_memory_mb']} MB ({r['redis_bytes_per_entry']} B/entry); new replica "
        f"to /healthz {r['replica_to_healthz_s']} s, to ready {r['replica_to_ready_s']} s, "
        f"RSS {r['replica_rss_mb']} MB; first answer compared with "
        f"{r['check']['cache_size']} entries (measured {r['check']['measured']})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replica", description=__doc__)
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kp-bench-replica-") as tmp:
        result = measure(args.size, Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(render(result))
    print(json.dumps(result["readyz_on_the_way"], indent=1), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
