"""The reference SDK side by side with the floor and the service (issue 21).

    python -m bench.reference [--quick] [--rounds N]     (also a phase of python -m bench)

When node and the folder bench/reference_setup.py prepares are at hand, the reference SDK's
`evaluateValue` runs in node (transformers.js, onnxruntime-node) on the same traces and the
same model file as the floor (bench/floor.py, in this process) and the service (over HTTP, a
preloaded `python -m app.serve`). Each round measures all three, in an order that turns from round to round
so that a host that speeds up or slows down touches each alike; the figures are the medians of
the rounds, with their range. Per round, one at a time: typical traces (p50) and long ones
(512-token window, p99); 16 closed-loop clients on the service against the floor's
one-at-a-time rate; and the cold start of each: a fresh process to its first answer (the
service: `python -m app.serve` spawned to its first POST /evaluate answered; the reference: node
spawned, transformers.js and the SDK imported, its first evaluateValue returned).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from bench import corpus, load
from bench.corpus import Item
from bench.floor import Floor
from bench.machine import machine, parse_env, provenance
from bench.server import HOST, ROOT, SERVE, Server, compile_app, free_port, fresh_data_home
from bench.stats import percentile

RUNNER = Path(__file__).resolve().parent / "reference_runner.mjs"
#: Issue 21: the service's 16-client rate against the floor's one-at-a-time rate.
CLIENTS = 16
CLIENTS_RATIO = 1.25
#: What is known for the other kind of CPU the service meets; this bench times only its own.
AVX2_NOTE = (
    "An AVX2-only CPU (no AVX-512, no VNNI) is timed only by running this bench on one: "
    "valgrind's emulation (scripts/int8_without_vnni.py) runs its kernels but says nothing of "
    "their speed. Known from issue 21: there the reference took 1.19x the floor's typical p50 "
    "and its long p99 1.23x the floor's long p50."
)


@dataclass(frozen=True, slots=True)
class Sizes:
    typical: int
    long: int
    clients_requests: int
    clients_seconds: float

    @classmethod
    def of(cls, quick: bool) -> Sizes:
        return cls(40, 10, 160, 3.0) if quick else cls(120, 24, 320, 6.0)


def available() -> Path | str:
    """The prepared reference folder, or why the phase is skipped."""
    from bench import reference_setup

    if shutil.which("node") is None:
        return "node is not installed"
    directory = reference_setup.default_dir()
    if not (directory / reference_setup.READY).exists():
        return (
            f"no reference SDK in {directory} (python -m bench.reference_setup prepares it; "
            "set KP_REFERENCE_DIR for another folder)"
        )
    # The runner and the model links follow this checkout.
    shutil.copyfile(RUNNER, directory / "runner.mjs")
    reference_setup.link_model(directory)
    return directory


class NodeReference:
    """One node process running bench/reference_runner.mjs, kept for the whole phase."""

    def __init__(self, directory: Path) -> None:
        self.process = subprocess.Popen(
            ["node", str(directory / "runner.mjs")],
            cwd=directory,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._read()  # {"ready": true}

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None  # opened with stdout=PIPE
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the reference runner exited ({self.process.wait()})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None  # opened with stdin=PIPE
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._read()

    def score(self, traces: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
        self.ask({"op": "clear"})
        answer = self.ask({"op": "score", "traces": traces})
        return answer["ms"], answer["scores"]

    def close(self) -> None:
        if self.process.stdin:
            self.process.stdin.close()
        self.process.wait(timeout=30)


def reference_cold(directory: Path, trace_file: Path) -> float:
    """Milliseconds from spawning node to the first evaluateValue's answer on stdout."""
    started = time.perf_counter()
    with subprocess.Popen(
        ["node", str(directory / "runner.mjs"), "--cold", str(trace_file)],
        cwd=directory,
        stdout=subprocess.PIPE,
        text=True,
    ) as process:
        assert process.stdout is not None
        line = process.stdout.readline()
        elapsed = (time.perf_counter() - started) * 1000
        process.wait(timeout=30)
    if not line:
        raise RuntimeError("the reference runner gave no answer to --cold")
    return elapsed


def service_cold(trace: dict[str, Any], log: Path, env: dict[str, str]) -> float:
    """Milliseconds from spawning the service (default settings: its load begins with the process)
    to its first POST /evaluate answered; the port is tried every 2 ms until it listens."""
    compile_app()
    port = free_port()
    request = load.evaluate_requests([trace], port)[0]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KP_")} | env
    data_home = fresh_data_home()  # a first start: the memory's default file made anew
    clean["XDG_DATA_HOME"] = data_home
    with log.open("ab") as out:
        started = time.perf_counter()
        process = subprocess.Popen(
            [*SERVE, "--host", HOST, "--port", str(port)],
            cwd=ROOT,
            env=clean,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"server exited with {process.returncode}")
                try:
                    with socket.create_connection((HOST, port), timeout=60) as conn:
                        conn.sendall(request)
                        answer = conn.recv(65536)
                        while b"\r\n\r\n" not in answer:
                            answer += conn.recv(65536)
                        elapsed = (time.perf_counter() - started) * 1000
                        break
                except ConnectionRefusedError:
                    time.sleep(0.002)
            if not answer.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"cold service answered {answer[:200]!r}")
            return elapsed
        finally:
            process.terminate()
            process.wait(timeout=30)
            shutil.rmtree(data_home, ignore_errors=True)


def _spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(
    directory: Path,
    rounds: int,
    quick: bool,
    log: Callable[[str], None] = print,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """`env`: KP_* settings for the service (its preloaded server and its cold starts)."""
    # Every round sends the same traces: the service's embedding memo would answer rounds 2
    # and on without the model, which the reference cannot do. Off, unless `env` says.
    env = {"KP_EMBED_MEMO_CAPACITY": "0", **(env or {})}
    sizes = Sizes.of(quick)
    typical = corpus.build("typical", sizes.typical, seed=21)
    long = corpus.build("long", sizes.long, seed=22)
    warm = corpus.build("typical", 20, seed=23)
    crowd = corpus.build("typical", sizes.clients_requests, seed=24)
    tmp = Path(tempfile.mkdtemp(prefix="kp-bench-ref-"))
    trace_file = tmp / "trace.json"
    trace_file.write_text(json.dumps(typical[0].trace))

    floor = Floor()
    node = NodeReference(directory)
    per_round: list[dict[str, float]] = []
    parity: list[float] = []
    try:
        with Server({"KP_EMBEDDER_PRELOAD": "true", **env}, tmp / "server.log") as server:
            port, pid = server.port, server.pid

            def bodies(items: list[Item]) -> list[bytes]:
                return load.evaluate_requests([i.trace for i in items], port)

            async def one_client(items: list[Item]) -> load.Phase:
                await load.reset_cache(port)
                return await load.closed_loop(port, bodies(items), 1, server_pid=pid)

            async def crowded() -> load.Phase:
                await load.reset_cache(port)
                return await load.closed_loop(
                    port, bodies(crowd), CLIENTS, max_seconds=sizes.clients_seconds
                )

            # Warm each once: first runs set up buffers in all three.
            floor.measure([i.text for i in warm], [])
            node.score([i.trace for i in warm])
            load.run(lambda: one_client(warm))

            def run_floor(r: dict[str, Any]) -> None:
                t = floor.measure([i.text for i in typical], [])
                lg = floor.measure([i.text for i in long], [])
                r |= {
                    "floor_typical_p50_ms": t["p50_ms"],
                    "floor_long_p50_ms": lg["p50_ms"],
                    "floor_long_p99_ms": lg["p99_ms"],
                    "floor_rate_rps": t["throughput_rps"],
                }

            def run_reference(r: dict[str, Any]) -> None:
                t_ms, t_scores = node.score([i.trace for i in typical])
                l_ms, _ = node.score([i.trace for i in long])
                r |= {
                    "reference_typical_p50_ms": percentile(t_ms, 50),
                    "reference_long_p50_ms": percentile(l_ms, 50),
                    "reference_long_p99_ms": percentile(l_ms, 99),
                    "reference_rate_rps": 1000 * len(t_ms) / sum(t_ms),
                }
                r["_reference_scores"] = t_scores

            def model_totals() -> list[tuple[float, float]]:
                async def both() -> list[tuple[float, float]]:
                    names = ("kp_embed_run_seconds", "kp_embed_queue_wait_seconds")
                    return [await load.histogram_totals(port, name) for name in names]

                return load.run(both)

            def run_service(r: dict[str, Any]) -> None:
                before = model_totals()
                t = load.run(lambda: one_client(typical))
                (run_sum, runs), (wait_sum, waits) = (
                    (s1 - s0, c1 - c0)
                    for (s0, c0), (s1, c1) in zip(before, model_totals(), strict=True)
                )
                lg = load.run(lambda: one_client(long))
                # Where a typical request's time goes, in means: the model's runs (tokenizing
                # included) as the service times them, and the rest (HTTP, the app, the
                # hand-offs between threads), which the floor and the reference do not have.
                mean = sum(t.latencies_ms) / t.count
                model = 1000 * run_sum / runs
                r |= {
                    "service_typical_mean_ms": mean,
                    "service_typical_model_ms": model,
                    "service_typical_around_model_ms": mean - model - 1000 * wait_sum / waits,
                    "service_typical_p50_ms": percentile(t.latencies_ms, 50),
                    "service_long_p50_ms": percentile(lg.latencies_ms, 50),
                    "service_long_p99_ms": percentile(lg.latencies_ms, 99),
                }
                r["_service_scores"] = [x["score"] for x in t.responses()]

            steps = [run_floor, run_reference, run_service]
            for i in range(rounds):
                log(f"reference phase: round {i + 1} of {rounds}")
                r: dict[str, Any] = {}
                for step in steps[i % 3 :] + steps[: i % 3]:
                    step(r)
                c = load.run(crowded)
                r["service_16_rate_rps"] = c.throughput_rps
                r["service_16_turned_away"] = len(c.turned_away_ms)
                colds: dict[str, Callable[[], float]] = {
                    "service_cold_ms": partial(
                        service_cold, typical[0].trace, tmp / "cold.log", env
                    ),
                    "reference_cold_ms": partial(reference_cold, directory, trace_file),
                }
                # Alternating which starts first from round to round.
                for key in sorted(colds, reverse=i % 2 == 0):
                    r[key] = colds[key]()
                ours, theirs = r.pop("_service_scores"), r.pop("_reference_scores")
                parity.append(max(abs(a - b) for a, b in zip(ours, theirs, strict=True)))
                per_round.append(r)
    finally:
        node.close()
    figures = {k: _spread([r[k] for r in per_round]) for k in per_round[0]}
    # Each ratio, per round: (numerator, denominator) figures of that round.
    ratio_of = {
        "typical_p50_vs_reference": ("service_typical_p50_ms", "reference_typical_p50_ms"),
        "long_p99_vs_reference": ("service_long_p99_ms", "reference_long_p99_ms"),
        "clients16_vs_floor_rate": ("service_16_rate_rps", "floor_rate_rps"),
        "cold_vs_reference": ("service_cold_ms", "reference_cold_ms"),
        "reference_typical_vs_floor": ("reference_typical_p50_ms", "floor_typical_p50_ms"),
        "reference_long_p50_vs_floor": ("reference_long_p50_ms", "floor_long_p50_ms"),
        "service_typical_vs_floor": ("service_typical_p50_ms", "floor_typical_p50_ms"),
        "service_long_p50_vs_floor": ("service_long_p50_ms", "floor_long_p50_ms"),
    }
    ratios = {
        name: [r[top] / r[bottom] for r in per_round] for name, (top, bottom) in ratio_of.items()
    }
    return {
        "rounds": rounds,
        "sizes": {"typical": sizes.typical, "long": sizes.long, "clients": CLIENTS},
        "figures": figures,
        "ratios": {k: _spread(v) for k, v in ratios.items()},
        "max_score_difference": max(parity),
        "per_round": per_round,
    }


def targets(ref: dict[str, Any]) -> list[tuple[str, str, bool]]:
    f, q = ref["figures"], ref["ratios"]

    def both(ours: str, theirs: str, digits: int = 2) -> str:
        return f"{f[ours]['median']:.{digits}f} vs {f[theirs]['median']:.{digits}f} ms"

    def ratio(name: str) -> str:
        s = q[name]
        return f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})"

    turned_away = int(f["service_16_turned_away"]["max"])
    return [
        (
            "vs reference: one client, typical p50 <= the reference's",
            f"{ratio('typical_p50_vs_reference')}: "
            + both("service_typical_p50_ms", "reference_typical_p50_ms"),
            q["typical_p50_vs_reference"]["median"] <= 1.0,
        ),
        (
            "vs reference: one client, long (512 tokens) p99 <= the reference's",
            f"{ratio('long_p99_vs_reference')}: "
            + both("service_long_p99_ms", "reference_long_p99_ms", 1),
            q["long_p99_vs_reference"]["median"] <= 1.0,
        ),
        (
            f"vs reference: {CLIENTS} clients >= {CLIENTS_RATIO}x the floor's one-at-a-time rate, no 503",
            f"{ratio('clients16_vs_floor_rate')}: {f['service_16_rate_rps']['median']:.0f} vs "
            f"{f['floor_rate_rps']['median']:.0f}/s (reference one at a time "
            f"{f['reference_rate_rps']['median']:.0f}/s), {turned_away} turned away",
            q["clients16_vs_floor_rate"]["median"] >= CLIENTS_RATIO and turned_away == 0,
        ),
        (
            "vs reference: cold start to first answer <= node start + import + first call",
            f"{ratio('cold_vs_reference')}: " + both("service_cold_ms", "reference_cold_ms", 0),
            q["cold_vs_reference"]["median"] <= 1.0,
        ),
    ]


def table(ref: dict[str, Any]) -> list[str]:
    f, q = ref["figures"], ref["ratios"]

    def cell(key: str, digits: int = 2) -> str:
        s = f[key]
        return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"

    def ratio(key: str) -> str:
        s = q[key]
        return f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})"

    return [
        f"### Side by side with the reference SDK ({ref['rounds']} interleaved rounds; "
        "median (min-max) of the rounds)",
        "",
        "| measure | floor | reference (node) | service (HTTP) |",
        "|---|---|---|---|",
        f"| typical p50, ms (n={ref['sizes']['typical']}) | {cell('floor_typical_p50_ms')} | "
        f"{cell('reference_typical_p50_ms')} | {cell('service_typical_p50_ms')} |",
        f"| long p50, ms (n={ref['sizes']['long']}) | {cell('floor_long_p50_ms', 1)} | "
        f"{cell('reference_long_p50_ms', 1)} | {cell('service_long_p50_ms', 1)} |",
        f"| long p99, ms | {cell('floor_long_p99_ms', 1)} | {cell('reference_long_p99_ms', 1)} | "
        f"{cell('service_long_p99_ms', 1)} |",
        f"| rate, /s | {cell('floor_rate_rps', 0)} (one at a time) | "
        f"{cell('reference_rate_rps', 0)} (one at a time) | {cell('service_16_rate_rps', 0)} "
        f"({CLIENTS} clients) |",
        f"| cold start to first answer, ms | - | {cell('reference_cold_ms', 0)} | "
        f"{cell('service_cold_ms', 0)} |",
        "",
        f"Reference / floor: typical p50 {ratio('reference_typical_vs_floor')}, long p50 "
        f"{ratio('reference_long_p50_vs_floor')}. Service / floor: typical p50 "
        f"{ratio('service_typical_vs_floor')}, long p50 {ratio('service_long_p50_vs_floor')}. "
        "Where a typical request's time goes in the service (means): "
        f"{cell('service_typical_mean_ms')} ms in all, of which the model's runs "
        f"{cell('service_typical_model_ms')} ms and the rest (HTTP, the app, the hand-offs "
        f"between threads) {cell('service_typical_around_model_ms')} ms. "
        f"Largest score difference, service against reference on the typical sequence: "
        f"{ref['max_score_difference']:.2e}.",
        "",
        AVX2_NOTE,
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.reference", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--env", action="append", default=[], metavar="KP_NAME=VALUE")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "reference.json")
    args = parser.parse_args(argv)
    where = available()
    if isinstance(where, str):
        print(f"reference phase skipped: {where}")
        return 0
    run = provenance()
    m = machine()
    env = parse_env(args.env)
    ref = measure(where, args.rounds, args.quick, lambda s: print(s, file=sys.stderr), env)
    doc = {
        "run": run,
        "machine": m,
        "env": env,
        "loadavg_end": Path("/proc/loadavg").read_text().split()[:3],
        **ref,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(
        f"CPU: {m['cpu']}, {m['nproc']} cores, flags {' '.join(m['cpu_flags']) or 'none of note'}; "
        f"onnxruntime {m['onnxruntime']}; load at start {m['loadavg_start']}"
    )
    print("\n".join(table(ref)))
    print()
    for name, value, passed in targets(ref):
        print(f"{'PASS' if passed else 'FAIL'}  {name}: {value}")
    print(f"\nwritten: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
