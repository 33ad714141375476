"""What a request refused by its key's rate costs, against a scored one and /healthz.

    python -m bench.rate_limit [--n 300]

One server as a user starts it (the model preloaded, KP_API_KEYS_FILE with two keys): one key
of one request a minute, spent at once, so every later request of it is a 429; one key without
a limit. Interleaved, one client: a typical trace's dry run with the unlimited key (a model
run), the same request with the spent key (429, refused before its body is read), and GET
/healthz (the floor of an HTTP round trip here). Medians in ms.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench import corpus
from bench.server import HOST, Server

LIMITED, OPEN = "bench-limited-key", "bench-open-key"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=300)
    args = parser.parse_args()
    items = corpus.build("typical", args.n, seed=21)
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.json"
        keys.write_text(
            json.dumps(
                {
                    "keys": [
                        {
                            "name": "limited",
                            "sha256": hashlib.sha256(LIMITED.encode()).hexdigest(),
                            "scopes": ["evaluate"],
                            "rate_per_minute": 1,
                        },
                        {
                            "name": "open",
                            "sha256": hashlib.sha256(OPEN.encode()).hexdigest(),
                            "scopes": ["evaluate"],
                        },
                    ]
                }
            )
        )
        env = {
            "KP_EMBEDDER_PRELOAD": "true",
            "KP_LOG_LEVEL": "warning",
            "KP_API_KEYS_FILE": str(keys),
        }
        with Server(env, Path(tmp) / "server.log") as server:
            client = httpx.Client(base_url=f"http://{HOST}:{server.port}", timeout=60)
            limited = {"Authorization": f"Bearer {LIMITED}"}
            scored = {"Authorization": f"Bearer {OPEN}"}
            dry = {"dry_run": "true"}
            assert client.post("/evaluate", json=items[0].trace, headers=limited).status_code == 200
            times: dict[str, list[float]] = {
                "scored (200)": [],
                "refused (429)": [],
                "/healthz": [],
            }
            calls = {
                "scored (200)": (scored, 200),
                "refused (429)": (limited, 429),
            }
            for item in items:
                for name, (headers, expected) in calls.items():
                    started = time.perf_counter()
                    r = client.post("/evaluate", json=item.trace, headers=headers, params=dry)
                    times[name].append((time.perf_counter() - started) * 1000)
                    assert r.status_code == expected, (name, r.status_code)
                started = time.perf_counter()
                assert client.get("/healthz").status_code == 200
                times["/healthz"].append((time.perf_counter() - started) * 1000)
            client.close()
    print(f"n={args.n} each, interleaved, one client; medians in ms")
    print("| request | p50 ms |")
    print("|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.3f} |")


if __name__ == "__main__":
    main()
