"""Which onnxruntime session options run the model fastest, and do they keep the vectors?

    python -m bench.session_options [--quick] [--rounds N]

In process, the service's own embedder code (OnnxEmbedder) with one session option changed
at a time, on the bench corpus: typical texts (p50) and full 512-token windows (p50, p99).
Every variant is open at once and the rounds take turns variant by variant, so that a host
that speeds up or slows down touches each alike; each figure is the median of the rounds. The
vectors of every variant are compared with the reference fixtures' (embedder_sequence.json):
the largest absolute difference per component. Writes bench/results/session_options.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from app.embedding import model_files
from app.embedding.onnx_embedder import OnnxEmbedder
from bench import corpus
from bench.stats import percentile

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "reference" / "embedder_sequence.json"
Tweak = Callable[[ort.SessionOptions], None]


def _level(level: ort.GraphOptimizationLevel) -> Tweak:
    def tweak(o: ort.SessionOptions) -> None:
        o.graph_optimization_level = level

    return tweak


def _config(key: str, value: str) -> Tweak:
    def tweak(o: ort.SessionOptions) -> None:
        o.add_session_config_entry(key, value)

    return tweak


def _both(*tweaks: Tweak) -> Tweak:
    def tweak(o: ort.SessionOptions) -> None:
        for t in tweaks:
            t(o)

    return tweak


ALL = _level(ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
EXTENDED = _level(ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED)
NO_SPIN = _config("session.intra_op.allow_spinning", "0")


def _threads(n: int) -> Tweak:
    def tweak(o: ort.SessionOptions) -> None:
        o.intra_op_num_threads = n

    return tweak


VARIANTS: dict[str, Tweak | None] = {
    "service (BASIC)": None,
    "EXTENDED": EXTENDED,
    "ALL": ALL,
    "BASIC, no spinning": NO_SPIN,
    "ALL, no spinning": _both(ALL, NO_SPIN),
    # Two threads named: onnxruntime pins its threads to cores only when it picks the count.
    "BASIC, 2 threads named": _threads(2),
    # One thread: the kernels' own cost, with no thread pool to wait on or spin in.
    "BASIC, 1 thread": _threads(1),
    "ALL, 1 thread": _both(ALL, _threads(1)),
    # Denormals flushed to zero (no slow path for tiny floats), and smaller blocks of work
    # handed to the pool threads.
    "BASIC, denormals as zero": _config("session.set_denormal_as_zero", "1"),
    "BASIC, dynamic block base 4": _config("session.intra_op.dynamic_block_base", "4"),
}


def open_variant(tweak: Tweak | None) -> OnnxEmbedder:
    """The service's embedder; with `tweak`, its session reopened with that change."""
    files = model_files.resolve(None, None)
    embedder = OnnxEmbedder(files.model, files.tokenizer, defer=True)
    if tweak is not None:
        o = ort.SessionOptions()
        o.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        o.log_severity_level = 3
        tweak(o)
        embedder._session = ort.InferenceSession(
            str(files.model), o, providers=["CPUExecutionProvider"]
        )
    embedder.warm_up()
    return embedder


def timed(embedder: OnnxEmbedder, texts: list[str]) -> tuple[list[float], float]:
    """Each text's milliseconds, and the process's CPU milliseconds per text (every thread:
    a spinning pool thread counts)."""
    out = []
    cpu = time.process_time()
    for text in texts:
        started = time.perf_counter()
        embedder.embed([text])
        out.append((time.perf_counter() - started) * 1000)
    return out, (time.process_time() - cpu) * 1000 / len(texts)


def parity(embedder: OnnxEmbedder) -> float:
    cases = json.loads(FIXTURE.read_text())["cases"]
    vectors = np.concatenate([embedder.embed([c["text"]]) for c in cases])
    expected = np.asarray([c["embedding"] for c in cases], dtype=np.float32)
    return float(np.max(np.abs(vectors - expected)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.session_options", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "session_options.json"
    )
    args = parser.parse_args(argv)
    typical = [i.text for i in corpus.build("typical", 30 if args.quick else 80, seed=31)]
    long = [i.text for i in corpus.build("long", 8 if args.quick else 20, seed=32)]
    embedders = {name: open_variant(tweak) for name, tweak in VARIANTS.items()}
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in embedders}
    names = list(embedders)
    for r in range(args.rounds):
        print(f"round {r + 1} of {args.rounds}", file=sys.stderr)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t, t_cpu = timed(embedders[name], typical)
            lg, l_cpu = timed(embedders[name], long)
            rounds[name].append(
                {
                    "typical_p50_ms": percentile(t, 50),
                    "long_p50_ms": percentile(lg, 50),
                    "long_p99_ms": percentile(lg, 99),
                    "typical_cpu_ms": t_cpu,
                    "long_cpu_ms": l_cpu,
                }
            )
    results: dict[str, dict[str, Any]] = {}
    base = names[0]
    for name in names:
        figures = {k: statistics.median(x[k] for x in rounds[name]) for k in rounds[name][0]}
        ratios = {
            k: statistics.median(
                a[k] / b[k] for a, b in zip(rounds[name], rounds[base], strict=True)
            )
            for k in figures
        }
        results[name] = {
            "figures": figures,
            "vs_service": ratios,
            "max_abs_vs_reference": parity(embedders[name]),
        }
    doc = {"onnxruntime": ort.__version__, "rounds": args.rounds, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(
        f"onnxruntime {ort.__version__}, {args.rounds} interleaved rounds, medians; ratios vs BASIC"
    )
    print(
        "| variant | typical p50 | long p50 | long p99 | CPU per typical / long text "
        "| max abs diff vs reference vectors |"
    )
    print("|---|---|---|---|---|---|")
    for name, res in results.items():
        f, q = res["figures"], res["vs_service"]
        print(
            f"| {name} | {f['typical_p50_ms']:.2f} ms ({q['typical_p50_ms']:.2f}x) | "
            f"{f['long_p50_ms']:.1f} ms ({q['long_p50_ms']:.2f}x) | "
            f"{f['long_p99_ms']:.1f} ms ({q['long_p99_ms']:.2f}x) | "
            f"{f['typical_cpu_ms']:.1f} ({q['typical_cpu_ms']:.2f}x) / "
            f"{f['long_cpu_ms']:.0f} ms ({q['long_cpu_ms']:.2f}x) | "
            f"{res['max_abs_vs_reference']:.2e} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
