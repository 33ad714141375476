"""What keeping the in-process memory costs (docs/operating/persistence.md): a committed
POST /evaluate at each durability, a 30,000-line POST /cache/import, and start to ready at
100,000 and 1,000,000 entries; side by side with the former snapshot and journal when a
checkout of the former release is given (`--former DIR`), in the same run.

    python -m bench persistence [--adds 600] [--requests 100] [--lines 30000]
        [--sizes 100000,1000000] [--starts 3] [--former DIR] [--only-step | --only-start]
        [--out FILE]

A whole run writes bench/results/persistence.json (rendered on docs/performance.md and
docs/operating/persistence.md); a partial one only where --out says.

`--former DIR` is either a release before the database (its snapshot and journal: `everysec`,
`always`) or one with it (its database at `process` and `power`, as this release's). With
the latter, the memory's step is also measured side by side with it: the same adds, run by
each checkout's own code in a process of its own, in blocks that take turns, and each block's
p50 ratio (this release / the former) reported with its spread.

Each server runs the real model (preloaded, one thread, no memo), the exact search, and the
servers take turns request by request in a rotating order, so that a busy host slows all of
them alike. A trace's commit cost is its p50 less the p50 of a server that keeps nothing.
`process` is set beside the former `everysec`, `power` beside `always`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.machine import machine, provenance
from bench.server import ADMIN_TOKEN, HOST, ROOT, Server
from bench.stats import percentile
from tests.factories import import_body

DEFAULT_OUT = ROOT / "bench" / "results" / "persistence.json"
#: (name, settings, former?): the memory kept nowhere, then each durability, now and before.
COMMON = {
    "KP_CACHE_CAPACITY": "100000",
    "KP_CACHE_SEARCH": "exact",
    "KP_EMBEDDER_PRELOAD": "true",
    "KP_EMBEDDER_THREADS": "1",
    "KP_EMBEDDER_WORKERS": "1",
    "KP_EMBED_MEMO_CAPACITY": "0",
    "KP_LOG_LEVEL": "warning",
}


def former_has_database(former: Path) -> bool:
    """Whether a checkout keeps the memory in SQLite (KP_CACHE_DB_PATH), as this one does."""
    return any(
        (former / "app" / where).is_file()
        for where in ("memory/sqlite.py", "store/sqlite_memory.py")
    )


def _modes(directory: Path, former: Path | None) -> dict[str, tuple[dict[str, str], Path | None]]:
    modes: dict[str, tuple[dict[str, str], Path | None]] = {
        "none": ({"KP_CACHE_DB_PATH": ":memory:"}, None)
    }
    for durability in ("process", "power"):
        modes[f"sqlite_{durability}"] = (
            {
                "KP_CACHE_DB_PATH": str(directory / f"{durability}.db"),
                "KP_CACHE_DURABILITY": durability,
            },
            None,
        )
    if former is not None and former_has_database(former):
        for durability in ("process", "power"):
            modes[f"former_{durability}"] = (
                {
                    "KP_CACHE_DB_PATH": str(directory / f"former-{durability}.db"),
                    "KP_CACHE_DURABILITY": durability,
                },
                former,
            )
    elif former is not None:
        for fsync in ("everysec", "always"):
            modes[f"former_{fsync}"] = (
                {
                    "KP_CACHE_SNAPSHOT_PATH": str(directory / f"{fsync}.snapshot"),
                    "KP_CACHE_SNAPSHOT_INTERVAL_S": "86400",
                    "KP_CACHE_JOURNAL_FSYNC": fsync,
                },
                former,
            )
    return modes


class _Server:
    def __init__(self, name: str, env: dict[str, str], root: Path | None, directory: Path):
        self.server = Server(
            COMMON | env, directory / f"{name}.log", timeout_s=180, root=root or ROOT
        )
        self.client = httpx.Client(
            base_url=f"http://{HOST}:{self.server.port}",
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=300,
        )
        snapshot = self.client.get("/readyz").json()["snapshot"]
        if root is not None and not former_has_database(root):
            # The former checkout's own code runs (its answer has no durability).
            assert "durability" not in snapshot, (name, snapshot)

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


def commits(requests: int, lines: int, former: Path | None) -> dict[str, Any]:
    """Each mode's p50 and p99 of a committed trace, and one import of `lines` lines."""
    with tempfile.TemporaryDirectory() as tmp:
        modes = _modes(Path(tmp), former)
        names = list(modes)
        servers = {name: _Server(name, *modes[name], Path(tmp)) for name in names}
        try:
            request_ms: dict[str, list[float]] = {name: [] for name in names}
            for i in range(requests):
                k = i % len(names)
                for name in names[k:] + names[:k]:
                    started = time.perf_counter()
                    r = servers[name].client.post("/evaluate", json=_trace(i))
                    request_ms[name].append((time.perf_counter() - started) * 1000)
                    r.raise_for_status()
            body = import_body(lines, seed=1, id_prefix="kp:trace:import-")
            import_s: dict[str, float] = {}
            for name in names:
                started = time.perf_counter()
                r = servers[name].client.post(
                    "/cache/import", content=body, headers={"content-type": "application/x-ndjson"}
                )
                import_s[name] = round(time.perf_counter() - started, 2)
                r.raise_for_status()
        finally:
            for server in servers.values():
                server.stop()
    base = percentile(request_ms["none"], 50)
    return {
        "requests": requests,
        "trace": {
            name: {
                "p50_ms": round(percentile(ms, 50), 3),
                "p99_ms": round(percentile(ms, 99), 3),
                "commit_ms": round(percentile(ms, 50) - base, 3),
            }
            for name, ms in request_ms.items()
        },
        "import_lines": lines,
        "import_s": import_s,
    }


def memory_step(adds: int) -> dict[str, Any]:
    """The memory's step of a committed trace in process (InProcessMemory.compare with add,
    a 1,000-entry memory): kept nowhere, then at each durability, taking turns in a rotating
    order; p50 and p99 in microseconds."""
    import asyncio

    from app.memory.base import DEFAULT_NAMESPACE
    from app.memory.in_process import InProcessMemory
    from app.memory.sqlite import SqliteStore

    vectors, _, _ = _entries(adds + 1000, seed=9)

    async def run(directory: Path) -> dict[str, list[float]]:
        memories = {
            "none": InProcessMemory(1000),
            **{
                d: InProcessMemory(1000, store=SqliteStore(directory / f"{d}.db", "bench", 384, d))
                for d in ("process", "power")
            },
        }
        for memory in memories.values():
            await memory.start()
            for i in range(1000):  # full, as a service soon is
                await memory.compare(DEFAULT_NAMESPACE, [vectors[i]], [f"w{i}"], add=True)
        us: dict[str, list[float]] = {name: [] for name in memories}
        names = list(memories)
        for i in range(adds):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                started = time.perf_counter()
                await memories[name].compare(
                    DEFAULT_NAMESPACE, [vectors[1000 + i]], [f"t{i}"], add=True
                )
                us[name].append((time.perf_counter() - started) * 1e6)
        for memory in memories.values():
            await memory.close()
        return us

    with tempfile.TemporaryDirectory() as tmp:
        us = asyncio.run(run(Path(tmp)))
    return {
        name: {"p50_us": round(percentile(v, 50), 1), "p99_us": round(percentile(v, 99), 1)}
        for name, v in us.items()
    }


#: Run by each checkout's own code (cwd): the memory's step of a committed trace at a
#: durability, against 1,000 entries; each line read ("N") is answered with the microseconds
#: of N more adds, as JSON.
_STEP_WORKER = """
import asyncio, json, sys, tempfile, time
from pathlib import Path
import numpy as np
try:
    from app.memory.in_process import InProcessMemory
    from app.memory.sqlite import SqliteStore
except ImportError:  # a release before app/ was grouped by concern
    from app.store.in_process import InProcessMemory
    from app.store.sqlite_memory import SqliteStore
durability, adds = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(9)
vectors = rng.standard_normal((adds + 1000, 384)).astype(np.float32)
vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)

async def main():
    with tempfile.TemporaryDirectory() as tmp:
        store = SqliteStore(Path(tmp) / "memory.db", "bench", 384, durability)
        memory = InProcessMemory(1000, store=store)
        await memory.start()
        for i in range(1000):
            await memory.compare("default", [vectors[i]], [f"w{i}"], add=True)
        i = 1000
        for line in sys.stdin:
            us = []
            for _ in range(int(line)):
                started = time.perf_counter()
                await memory.compare("default", [vectors[i]], [f"t{i}"], add=True)
                us.append((time.perf_counter() - started) * 1e6)
                i += 1
            print(json.dumps(us), flush=True)
        await memory.close()

asyncio.run(main())
"""


def step_against_former(
    former: Path, adds: int, block: int = 50, durability: str = "process"
) -> dict[str, Any]:
    """The memory's step of a committed trace at `durability`, this checkout's code and the
    former's, each in a process of its own, `block` adds at a time taking turns (the first
    to go alternates): p50 and p99 of each, and each block's p50 ratio (this / former) with
    its spread."""
    workers = {
        side: subprocess.Popen(
            [sys.executable, "-c", _STEP_WORKER, durability, str(adds)],
            cwd=root,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for side, root in (("this", ROOT), ("former", former))
    }
    us: dict[str, list[float]] = {side: [] for side in workers}
    ratios: list[float] = []
    try:
        for round_ in range(adds // block):
            order = ["this", "former"] if round_ % 2 == 0 else ["former", "this"]
            medians = {}
            for side in order:
                worker = workers[side]
                assert worker.stdin is not None
                assert worker.stdout is not None
                worker.stdin.write(f"{block}\n")
                worker.stdin.flush()
                times = json.loads(worker.stdout.readline())
                us[side] += times
                medians[side] = percentile(times, 50)
            ratios.append(medians["this"] / medians["former"])
    finally:
        for worker in workers.values():
            assert worker.stdin is not None
            worker.stdin.close()
            worker.wait(timeout=120)
    q = np.percentile(np.asarray(ratios), [0, 25, 50, 75, 100]).tolist()
    return {
        "durability": durability,
        "adds": len(us["this"]),
        "block": block,
        **{
            side: {
                "p50_us": round(percentile(times, 50), 1),
                "p99_us": round(percentile(times, 99), 1),
            }
            for side, times in us.items()
        },
        "ratio_p50": {
            name: round(value, 3)
            for name, value in zip(("min", "q1", "median", "q3", "max"), q, strict=True)
        },
    }


def _model_id() -> str:
    from app.embedding import model_files

    return model_files.identity(model_files.resolve(None, None), "float32")


def _entries(size: int, seed: int = 3) -> tuple[np.ndarray, np.ndarray, list[str]]:
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((size, 384)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    times = time.time() * 1000.0 - size + np.arange(size, dtype=np.float64)
    return vectors, times, [f"kp:trace:start-{i}" for i in range(size)]


def write_database(path: Path, model_id: str, size: int) -> None:
    """A database of `size` entries in the default namespace, as the service writes them."""
    from app.memory.in_process import InProcessMemory
    from app.memory.sqlite import SqliteStore
    from app.memory.sqlite_rows import NewRow

    vectors, times, ids = _entries(size)
    store = SqliteStore(path, model_id, 384, "process")
    store.open(InProcessMemory(1))  # a new file: nothing to load
    for start in range(0, size, 10_000):
        stop = min(size, start + 10_000)
        store.write(
            [
                NewRow("default", ids[i], float(times[i]), vectors[i].astype("<f4").tobytes())
                for i in range(start, stop)
            ]
        )
    store.close()


#: Run in the former checkout: its own snapshot writer, the same entries as _entries.
_FORMER_SNAPSHOT = """
import sys, time, numpy as np
from pathlib import Path
from app.memory.ring import CacheEntries
from app.service.snapshots import write_snapshot
size = int(sys.argv[2])
rng = np.random.default_rng(3)
vectors = rng.standard_normal((size, 384)).astype(np.float32)
vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
times = time.time() * 1000.0 - size + np.arange(size, dtype=np.float64)
ids = [f"kp:trace:start-{i}" for i in range(size)]
write_snapshot(Path(sys.argv[1]), CacheEntries(vectors, times, ids), sys.argv[3])
"""


def _ready_s(env: dict[str, str], root: Path | None, log: Path) -> float:
    started = time.perf_counter()
    server = Server(COMMON | env, log, timeout_s=600, root=root or ROOT)
    try:
        with httpx.Client(base_url=f"http://{HOST}:{server.port}", timeout=60) as c:
            while (ready := c.get("/readyz").json())["status"] != "ready":
                time.sleep(0.05)
            assert ready["cache_size"] > 0, ready
        return round(time.perf_counter() - started, 2)
    finally:
        server.stop()


def start_to_ready(sizes: list[int], former: Path | None, starts: int = 1) -> dict[str, Any]:
    """From the process's start to /readyz ready, on a memory of each size, `starts` times
    (the database and the former snapshot in turn)."""
    model_id = _model_id()
    out: dict[str, Any] = {}
    for size in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            directory = Path(tmp)
            path = directory / "memory.db"
            write_database(path, model_id, size)
            figures: dict[str, Any] = {"database_mb": round(path.stat().st_size / 2**20)}
            snapshot = directory / "memory.snapshot"
            if former is not None:
                subprocess.run(
                    [sys.executable, "-c", _FORMER_SNAPSHOT, str(snapshot), str(size), model_id],
                    cwd=former,
                    check=True,
                )
            for _ in range(starts):
                figures.setdefault("sqlite_s", []).append(
                    _ready_s(
                        {"KP_CACHE_DB_PATH": str(path), "KP_CACHE_CAPACITY": str(size)},
                        None,
                        directory / "sqlite.log",
                    )
                )
                if former is not None:
                    figures.setdefault("former_s", []).append(
                        _ready_s(
                            {
                                "KP_CACHE_SNAPSHOT_PATH": str(snapshot),
                                "KP_CACHE_SNAPSHOT_INTERVAL_S": "86400",
                                "KP_CACHE_CAPACITY": str(size),
                            },
                            former,
                            directory / "former.log",
                        )
                    )
            out[str(size)] = figures
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench persistence", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--lines", type=int, default=30_000)
    parser.add_argument("--sizes", default="100000,1000000")
    parser.add_argument(
        "--former", type=Path, default=None, help="a checkout of the former release, to compare"
    )
    parser.add_argument("--adds", type=int, default=600, help="in-process adds per mode")
    parser.add_argument(
        "--former-adds",
        type=int,
        default=6000,
        help="adds per side of the step against a former release that has the database",
    )
    parser.add_argument("--former-block", type=int, default=50, help="adds per turn of a side")
    parser.add_argument("--skip-commits", action="store_true")
    parser.add_argument("--only-step", action="store_true")
    parser.add_argument(
        "--only-start", action="store_true", help="only start to ready, at each of --sizes"
    )
    parser.add_argument("--starts", type=int, default=3, help="starts to ready at each size")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"where the figures go (default: {DEFAULT_OUT.relative_to(ROOT)} after a whole run)",
    )
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"run": provenance(), "machine": machine()}
    if not args.only_start:
        result["memory_step"] = memory_step(args.adds)
        if args.former is not None and former_has_database(args.former):
            result["step_against_former"] = step_against_former(
                args.former, args.former_adds, args.former_block
            )
    if not args.skip_commits and not args.only_step and not args.only_start:
        result["commits"] = commits(args.requests, args.lines, args.former)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if not args.only_step:
        result["start_to_ready"] = start_to_ready(sizes, args.former, args.starts)
    text = json.dumps(result, indent=2)
    print(text)
    whole = not (args.skip_commits or args.only_step or args.only_start)
    out = args.out or (DEFAULT_OUT if whole else None)
    if out is not None:
        out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
