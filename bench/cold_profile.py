"""Where a cold start's time goes: `python -m app.serve` spawned to its first answer, in parts.

    python -m bench.cold_profile [--rounds N] [--base DIR]

Each round spawns the service as bench.reference's cold start does (default settings, the
model's load started with the process) through a probe that wraps the steps of the real path
and records when each ends (ms since the spawn, on the monotonic clock both processes share)
and, for the model's steps, the CPU time of their thread (wall far above CPU: the step waited
for the GIL or a core). The model cache (KP_MODEL_CACHE, app/embedding/session_cache.py) is
on in one start and off in the other, in turns: its entry is written by a first start, not
timed. Then a fresh session's first runs (what a warm-up run at load would take off the
first request), and one `-X importtime` run of the same imports, one thread, grouped by
top-level package. Medians of the rounds; the host's load moves them, so compare within one run.
`--base DIR` (another checkout, e.g. `git worktree add /tmp/base main`, run by this
interpreter): this checkout's starts and DIR's take turns instead, both with the model cache.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.cold_probe import OUT as _OUT
from bench.cold_probe import SPAWNED as _SPAWNED
from bench.server import HOST, ROOT, compile_app, free_port

# ── the driver ──


def _start(
    port: int, env: dict[str, str], out: Path, root: Path
) -> tuple[float, subprocess.Popen[bytes]]:
    spawned = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.cold_probe", str(port)],
        cwd=root,
        env={**env, _SPAWNED: repr(spawned), _OUT: str(out)},
        stdout=subprocess.DEVNULL,
        stderr=None if os.environ.get("COLD_PROFILE_DEBUG") else subprocess.DEVNULL,
    )
    return spawned, process


def one_start(env: dict[str, str], trace_body: bytes, root: Path = ROOT) -> list[dict[str, Any]]:
    """One cold start of `root`'s service to its first answer: the probe's marks and the
    client's."""
    from bench import load

    port = free_port()
    (request,) = load.evaluate_requests([json.loads(trace_body)], port)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "marks.json"
        spawned, process = _start(port, env, out, root)
        try:
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"the service exited with {process.returncode}")
                try:
                    with socket.create_connection((HOST, port), timeout=60) as conn:
                        sent = time.perf_counter()
                        conn.sendall(request)
                        answer = conn.recv(65536)
                        while b"\r\n\r\n" not in answer:
                            answer += conn.recv(65536)
                        done = time.perf_counter()
                        break
                except ConnectionRefusedError:
                    time.sleep(0.002)
            if not answer.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"the service answered {answer[:200]!r}")
        finally:
            process.terminate()
            process.wait(30)
        marks: list[dict[str, Any]] = json.loads(out.read_text())
    marks.append({"step": "client: request sent", "at_ms": (sent - spawned) * 1000})
    marks.append({"step": "client: answer received", "at_ms": (done - spawned) * 1000})
    return marks


def import_groups(top: int = 14) -> list[tuple[str, float]]:
    """Self time of the default start's imports by top-level package (one thread, -X
    importtime; the service's threads import some of them side by side). FastAPI is imported
    as a start imports it (its OpenAPI models deferred, no pydantic plugin search), but not
    through app.serve.prepare: its early-load thread's imports would count its waits for the
    other thread's as import time. The cyclic collector is off, as the start has it: its
    passes would fall on whichever module happens to be importing."""
    code = (
        "import gc\n"
        "gc.disable()\n"
        "import app.serve\n"
        "app.serve.import_fastapi_deferring_its_models()\n"
        "import uvicorn, app.main, app.server.protocol, uvicorn.lifespan.on, "
        "uvicorn.loops.auto, app.embedding.onnx_embedder, app.embedding.session_cache\n"
        "from app.core.config import Settings\n"
        "Settings.from_env()\n"
    )
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        cwd=ROOT,
        env={"PYDANTIC_DISABLE_PLUGINS": "__all__", **_env()},
        capture_output=True,
        text=True,
        check=True,
    )
    groups: dict[str, float] = {}
    for line in done.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+\d+ \|\s*(\S+)", line)
        if m:
            name = m[2].split(".")[0]
            groups[name] = groups.get(name, 0.0) + int(m[1]) / 1000
    ranked = sorted(groups.items(), key=lambda g: -g[1])[:top]
    return [("(all)", sum(groups.values())), *ranked]


_FIRST_RUNS = """
import json, sys, time
from app.embedding import model_files
from app.embedding.onnx_embedder import OnnxEmbedder
files = model_files.resolve(None, None)
embedder = OnnxEmbedder(files.model, files.tokenizer, defer=True)
tokens = embedder.tokenize([sys.argv[1]])
took = []
for _ in range(4):
    start = time.perf_counter()
    embedder.embed_tokenized(tokens)
    took.append((time.perf_counter() - start) * 1000)
print(json.dumps(took))
"""


def first_runs(text: str, processes: int) -> list[list[float]]:
    """ms of a fresh session's first four runs of `text`, in `processes` fresh processes: what
    a warm-up run at load would take off the first request."""
    runs = []
    for _ in range(processes):
        done = subprocess.run(
            [sys.executable, "-c", _FIRST_RUNS, text],
            cwd=ROOT,
            env=_env(),
            capture_output=True,
            text=True,
            check=True,
        )
        runs.append(json.loads(done.stdout))
    return runs


def _env(**kp: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KP_")}
    return {**clean, "KP_EMBED_MEMO_CAPACITY": "0", **kp}


def _at(marks: list[dict[str, Any]], step: str) -> float:
    (at,) = (m["at_ms"] for m in marks if m["step"] == step)
    return float(at)


def _table(runs: list[list[dict[str, Any]]]) -> list[str]:
    """Each step's median end (and duration, CPU) over the runs, in order of its end."""
    steps: dict[str, list[dict[str, Any]]] = {}
    for marks in runs:
        for m in marks:
            steps.setdefault(m["step"], []).append(m)
    rows = []
    for step, seen in steps.items():
        at = statistics.median(m["at_ms"] for m in seen)
        took = [m["took_ms"] for m in seen if "took_ms" in m]
        cpu = [m["cpu_ms"] for m in seen if "cpu_ms" in m]
        note = f" [{seen[0]['model_cache'] or 'no cache'}]" if "model_cache" in seen[0] else ""
        span = f"{statistics.median(took):7.1f} {statistics.median(cpu):7.1f}" if took else ""
        rows.append(
            (at, f"{at:8.1f}  {span:15s}  {seen[0].get('thread', 'client')[:13]:13s} {step}{note}")
        )
    return [row for _, row in sorted(rows)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cold_profile")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--base", type=Path, help="another checkout whose start to compare")
    args = parser.parse_args(argv)
    from bench import corpus

    compile_app()
    item = corpus.build("typical", 1, seed=21)[0]
    trace = json.dumps(item.trace).encode()
    with tempfile.TemporaryDirectory(prefix="kp-cold-") as cache_dir:
        cached = _env(KP_MODEL_CACHE_DIR=cache_dir)
        modes: dict[str, tuple[dict[str, str], Path]] = {
            "model cache on": (cached, ROOT),
            "model cache off": (_env(KP_MODEL_CACHE="false"), ROOT),
        }
        if args.base is not None:
            base = args.base.resolve()
            compile_app(base)
            modes = {"this checkout": (cached, ROOT), f"base {base}": (cached, base)}
        one_start(cached, trace)  # writes the cache's entry; not timed
        runs: dict[str, list[list[dict[str, Any]]]] = {mode: [] for mode in modes}
        for i in range(args.rounds):
            for mode in sorted(modes, reverse=i % 2 == 1):
                env, root = modes[mode]
                runs[mode].append(one_start(env, trace, root))
    header = f"{'end, ms':>8s}  {'took':>7s} {'cpu':>7s}  {'thread':13s} step"
    for mode, marks in runs.items():
        answers = [_at(r, "client: answer received") for r in marks]
        # per start: what the first request itself waited, from its send to its answer
        waits = [_at(r, "client: answer received") - _at(r, "client: request sent") for r in marks]
        after = [_at(r, "client: answer received") - _at(r, "model run") for r in marks]
        print(
            f"\n{mode}: spawn to first answer, median {statistics.median(answers):.0f} ms "
            f"({min(answers):.0f}-{max(answers):.0f}) over {len(answers)} starts; the first "
            f"request, sent to answered, {statistics.median(waits):.1f} ms "
            f"({min(waits):.1f}-{max(waits):.1f}), from the end of its model run "
            f"{statistics.median(after):.1f} ms ({min(after):.1f}-{max(after):.1f})"
        )
        print(header)
        for row in _table(marks):
            print(row)
    fresh = first_runs(item.text, args.rounds)
    print("\na fresh session's runs 1-4 of a typical text, medians of fresh processes (ms): ")
    print("  " + ", ".join(f"{statistics.median(r[i] for r in fresh):.1f}" for i in range(4)))
    print("\nimports of the default start, one thread, self time by package (ms):")
    print("  " + ", ".join(f"{name} {ms:.0f}" for name, ms in import_groups()))


if __name__ == "__main__":
    main()
