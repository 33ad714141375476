"""One model run per text: a commit after a dry run, against a fresh trace.

    python -m bench.memo [--n 40] [--out bench/results/memo.json]

Two servers as a user starts them (the model preloaded), one with the memo of recent vectors
(KP_EMBED_MEMO_CAPACITY's default) and one without (0). For each trace of the benchmark's
corpus (typical and full-window traces), interleaved across the two servers: the dry run of a
fresh trace (a model run), then its commit. The target (issue 20): with the memo, the commit
takes at most half the time of the fresh trace's dry run. Without the memo the commit runs the
model again, which the second column shows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench import corpus
from bench.__main__ import machine
from bench.server import HOST, Server

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "memo.json"
ENV = {"KP_EMBEDDER_PRELOAD": "true", "KP_LOG_LEVEL": "warning"}


def timed(client: httpx.Client, trace: dict[str, Any], dry_run: bool) -> float:
    params = {"dry_run": "true"} if dry_run else {}
    started = time.perf_counter()
    r = client.post("/evaluate", json=trace, params=params)
    elapsed = time.perf_counter() - started
    r.raise_for_status()
    return elapsed * 1000


def measure(n: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        servers = {
            "memo": Server(ENV, Path(tmp) / "memo.log"),
            "no_memo": Server({**ENV, "KP_EMBED_MEMO_CAPACITY": "0"}, Path(tmp) / "none.log"),
        }
        try:
            clients = {
                name: httpx.Client(base_url=f"http://{HOST}:{s.port}", timeout=60)
                for name, s in servers.items()
            }
            for kind in ("typical", "long"):
                items = corpus.build(kind, n, seed=20)
                times: dict[str, dict[str, list[float]]] = {
                    name: {"fresh_dry_run": [], "commit": []} for name in servers
                }
                for item in items:
                    for name, client in clients.items():
                        times[name]["fresh_dry_run"].append(timed(client, item.trace, True))
                        times[name]["commit"].append(timed(client, item.trace, False))
                results[kind] = {
                    name: {k: round(statistics.median(v), 3) for k, v in t.items()}
                    for name, t in times.items()
                }
                for row in results[kind].values():
                    row["ratio"] = round(row["commit"] / row["fresh_dry_run"], 3)
            for client in clients.values():
                client.close()
        finally:
            for s in servers.values():
                s.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=40, help="traces of each kind")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    results = measure(args.n)
    print(f"n={args.n} traces of each kind; medians in ms, one client, model preloaded")
    print("| traces | server | fresh dry run | commit after it | ratio | target <= 0.5 |")
    print("|---|---|---|---|---|---|")
    for kind, rows in results.items():
        for name, row in rows.items():
            verdict = ("PASS" if row["ratio"] <= 0.5 else "FAIL") if name == "memo" else "-"
            print(
                f"| {kind} | {name} | {row['fresh_dry_run']:.2f} | {row['commit']:.2f} "
                f"| {row['ratio']:.3f} | {verdict} |"
            )
    args.out.write_text(
        json.dumps({"machine": machine(), "n": args.n, "results": results}, indent=2)
    )


if __name__ == "__main__":
    main()
