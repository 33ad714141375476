"""Cold start: a fresh service's first answer against the floor's own load and first run.

Alternates N fresh service processes (python -m app.serve, lazy model load) with N fresh bare processes
(onnxruntime session + tokenizers, one run), so a host whose speed drifts skews both alike:

    python -m bench cold [--n N]

Per pair: the service's first POST /evaluate (its server already answering /healthz) against
the floor's load + first run in its own process, and both from process start to first answer.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

from bench.server import HOST, ROOT, SERVE, compile_app, free_port, fresh_data_home

_FLOOR = """
import time
t0 = time.perf_counter()
import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer
from app.embedding import model_files
t1 = time.perf_counter()
files = model_files.resolve(None, None)
tok = Tokenizer.from_file(str(files.tokenizer))
tok.enable_truncation(512)
s = ort.InferenceSession(str(files.model), providers=["CPUExecutionProvider"])
ids = np.asarray([tok.encode(%r).ids], dtype=np.int64)
(h,) = s.run(["last_hidden_state"], {"input_ids": ids, "attention_mask": np.ones_like(ids),
                                     "token_type_ids": np.zeros_like(ids)})
v = h[0].mean(axis=0)
v = v / np.linalg.norm(v)
print((time.perf_counter() - t1) * 1000)
"""

_TRACE = {
    "@context": "https://openknowledgepulse.org/schema/v1",
    "@type": "ReasoningTrace",
    "id": "kp:trace:cold-start",
    "metadata": {
        "created_at": "2025-06-15T10:00:00.000Z",
        "task_domain": "default",
        "success": True,
        "quality_score": 0,
        "visibility": "network",
        "privacy_level": "aggregated",
    },
    "task": {"objective": "Review PR #42 for security issues"},
    "steps": [
        {"step_id": 0, "type": "thought", "content": "Analyzing diff for injection vectors"},
        {"step_id": 1, "type": "observation", "content": "Found unsanitized SQL in handler.ts"},
    ],
    "outcome": {"result_summary": "Done", "confidence": 1.0},
}
_TEXT = "Review PR #42 for security issues Analyzing diff for injection vectors"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KP_")}
    return {**env, "KP_LOG_LEVEL": "warning"}


def service_once() -> tuple[float, float]:
    """(ms from process start to the first answer, ms of the first POST /evaluate)."""
    compile_app()
    port = free_port()
    base = f"http://{HOST}:{port}"
    # A fresh data directory: each start is a first start (its memory's default file made
    # anew, empty), and none meets another's database.
    data_home = fresh_data_home()
    started = time.perf_counter()
    proc = subprocess.Popen(
        [*SERVE, "--host", HOST, "--port", str(port)],  # KP_LOG_LEVEL=warning: _env
        cwd=ROOT,
        env=_env() | {"XDG_DATA_HOME": data_home},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while True:
            try:
                urllib.request.urlopen(f"{base}/healthz", timeout=5).read()
                break
            except (urllib.error.URLError, ConnectionError):
                if proc.poll() is not None:
                    raise RuntimeError("the service exited") from None
                time.sleep(0.005)
        request = urllib.request.Request(
            f"{base}/evaluate",
            data=json.dumps(_TRACE).encode(),
            headers={"Content-Type": "application/json"},
        )
        sent = time.perf_counter()
        body = json.loads(urllib.request.urlopen(request, timeout=60).read())
        done = time.perf_counter()
        if body["novelty"]["reason"] != "cache_empty":
            raise RuntimeError(f"unexpected first answer: {body['novelty']}")
        return (done - started) * 1000, (done - sent) * 1000
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(data_home, ignore_errors=True)


def floor_once() -> tuple[float, float]:
    """(ms from process start to the first vector, ms of load + first run after imports)."""
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", _FLOOR % _TEXT],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    return (time.perf_counter() - started) * 1000, float(out.stdout.strip())


#: The service's start to its first answer, at most this many times the floor's start to its
#: first vector (docs/decisions/start-up-tricks.md).
TARGET = 1.5


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench cold", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--n", type=int, default=5, help="pairs of fresh processes")
    parser.add_argument("--quick", action="store_true", help="3 pairs")
    args = parser.parse_args(argv)
    n = 3 if args.quick else args.n
    rows = []
    for _ in range(n):
        service_total, first_request = service_once()
        floor_total, floor_load_run = floor_once()
        rows.append((service_total, first_request, floor_total, floor_load_run))
        print(
            f"service: start->answer {service_total:7.0f} ms, first request {first_request:6.0f} ms"
            f" | floor: start->vector {floor_total:6.0f} ms, load+run {floor_load_run:6.0f} ms"
            f" | ratios {service_total / floor_total:.2f} / {first_request / floor_load_run:.2f}",
            flush=True,
        )
    med = [statistics.median(col) for col in zip(*rows, strict=True)]
    first = [r[1] / r[3] for r in rows]
    total = [r[0] / r[2] for r in rows]
    ratio = med[0] / med[2]
    print(
        f"median: first request / floor load+run = {med[1]:.0f}/{med[3]:.0f} ms = "
        f"{med[1] / med[3]:.2f}x (pairs {min(first):.2f}-{max(first):.2f}); "
        f"start->answer / floor start->vector = {med[0]:.0f}/{med[2]:.0f} ms = "
        f"{ratio:.2f}x (pairs {min(total):.2f}-{max(total):.2f})"
    )
    print(f"{'PASS' if ratio <= TARGET else 'FAIL'}  start->answer <= {TARGET}x the floor's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
