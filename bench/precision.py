"""int8 mode against float32, in process: speed per text and how far scores move.

    python -m bench.precision [--quick] [--out bench/results/precision.json]

Speed, on the benchmark's typical and long texts (the same seeds as `python -m bench`):
per-text p50/p99 of one model run with all cores (a request alone in the service), and texts/s
of two one-core runs side by side (the service under load). Three rounds, float32 then int8 in
each, so a busy neighbour slows both alike.

Deviation: each corpus (the benchmark's typical + long traces; the reference SDK's embedder
sequence, tests/fixtures/reference) is scored in order through the service's own Evaluator,
once per precision, each with an empty cache: the largest and mean |score change|, the largest
|max_cosine change|, and the lowest cosine between a text's two vectors. The issue's bound for
shipping int8 is a score change under 0.01.

int8 runs as the service would run it on this CPU (app/embedding/int8_support.py: int8 weights
with VNNI, uint8 weights without); where int8 mode declines, this says so and measures nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from app.core.states import Precision
from app.embedding import model_files
from app.embedding.embeddings import EmbeddingService
from app.embedding.int8_support import int8_support
from app.embedding.onnx_embedder import OnnxEmbedder
from app.embedding.token_window import Window
from app.memory.in_process import InProcessMemory
from app.schemas.trace import ReasoningTrace
from app.service.evaluator import Evaluator
from bench import corpus
from bench.machine import machine, provenance
from bench.stats import percentile

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "precision.json"
FIXTURE = Path(__file__).resolve().parents[1] / "tests/fixtures/reference/embedder_sequence.json"
PRECISIONS: tuple[Precision, ...] = ("float32", "int8")


def load_embedder(precision: Precision) -> OnnxEmbedder:
    """The embedder as the service loads it here (int8 with the weights this CPU needs)."""
    files = model_files.resolve(None, None)
    model_files.verify(files)
    return OnnxEmbedder(
        files.model,
        files.tokenizer,
        concurrent_runs=2,
        precision=precision,
        int8_weights=int8_support().weights if precision == "int8" else None,
    )


def per_text_ms(embedder: OnnxEmbedder, texts: list[Window]) -> list[float]:
    """One run per text on the all-core session, in a loop as the floor runs."""
    for text in texts[:5]:
        embedder.embed_tokenized([text])
    times = []
    for text in texts:
        started = time.perf_counter()
        embedder.embed_tokenized([text])
        times.append((time.perf_counter() - started) * 1000)
    return times


def side_by_side_per_s(embedder: OnnxEmbedder, texts: list[Window]) -> float:
    """Texts/s of two one-core runs at a time, as two service workers under load."""
    halves = [texts[0::2], texts[1::2]]

    def work(part: list[Window]) -> None:
        for text in part:
            embedder.embed_tokenized([text], one_core=True)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(work, [h[:5] for h in halves]))  # warm-up
        started = time.perf_counter()
        list(pool.map(work, halves))
        return len(texts) / (time.perf_counter() - started)


def scored(embedder: OnnxEmbedder, traces: list[ReasoningTrace]) -> dict[str, list[Any]]:
    """Scores and max_cosines of the traces evaluated in order, from an empty cache."""

    async def run() -> dict[str, list[Any]]:
        service = EmbeddingService(lambda: embedder, model_name="bench", workers=1)
        await service.load()
        evaluator = Evaluator(InProcessMemory(1000), service)
        out: dict[str, list[Any]] = {"score": [], "max_cosine": []}
        for trace in traces:
            (evaluation,) = await evaluator.evaluate([trace])
            out["score"].append(evaluation.score.value)
            out["max_cosine"].append(evaluation.novelty.max_cosine)
        await service.close()
        return out

    return asyncio.run(run())


def deviation(
    embedders: dict[Precision, OnnxEmbedder], traces: list[ReasoningTrace], texts: list[str]
) -> dict[str, float]:
    base, int8 = (scored(embedders[p], traces) for p in PRECISIONS)
    score_change = np.abs(np.subtract(int8["score"], base["score"]))
    cosine_change = [
        abs(a - b)
        for a, b in zip(int8["max_cosine"], base["max_cosine"], strict=True)
        if a is not None and b is not None
    ]
    a, b = (
        np.vstack([embedders[p].embed([t]) for t in texts]).astype(np.float64) for p in PRECISIONS
    )
    return {
        "traces": len(traces),
        "max_score_change": float(score_change.max()),
        "mean_score_change": float(score_change.mean()),
        "over_0.005": int((score_change > 0.005).sum()),
        "max_max_cosine_change": max(cosine_change),
        "min_vector_cosine": float((a * b).sum(axis=1).min()),
    }


def speed(texts: dict[str, list[str]], rounds: int) -> dict[str, dict[str, float]]:
    """Each precision's figures, one embedder alive at a time (another session's idle pool
    threads slowed the measured one by a third), the precisions alternating round by round."""
    times: dict[tuple[str, str], list[float]] = {}
    rates: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for precision in PRECISIONS:
            embedder = load_embedder(precision)
            for kind, kind_texts in texts.items():
                tokens = embedder.tokenize(kind_texts)
                times.setdefault((kind, precision), []).extend(per_text_ms(embedder, tokens))
                rates.setdefault((kind, precision), []).append(side_by_side_per_s(embedder, tokens))
            del embedder
    out: dict[str, dict[str, float]] = {}
    for kind in texts:
        figures = out[kind] = {}
        for p in PRECISIONS:
            figures[f"{p}_p50_ms"] = percentile(times[kind, p], 50)
            figures[f"{p}_p99_ms"] = percentile(times[kind, p], 99)
            figures[f"{p}_two_one_core_runs_per_s"] = statistics.median(rates[kind, p])
        figures["int8_per_text_ratio"] = figures["int8_p50_ms"] / figures["float32_p50_ms"]
        figures["int8_throughput_ratio"] = (
            figures["int8_two_one_core_runs_per_s"] / figures["float32_two_one_core_runs_per_s"]
        )
    return out


def measure(quick: bool) -> dict[str, Any]:
    typical = corpus.build("typical", 60 if quick else 300, seed=1)
    long = corpus.build("long", 15 if quick else 60, seed=2)
    texts = {"typical": [i.text for i in typical], "long": [i.text for i in long]}
    out: dict[str, Any] = {"speed": speed(texts, rounds=1 if quick else 3), "deviation": {}}
    embedders = {p: load_embedder(p) for p in PRECISIONS}
    bench_items = typical + long
    fixture = json.loads(FIXTURE.read_text())["cases"]
    out["deviation"]["bench"] = deviation(
        embedders,
        [ReasoningTrace.model_validate(i.trace) for i in bench_items],
        [i.text for i in bench_items],
    )
    out["deviation"]["reference_fixtures"] = deviation(
        embedders,
        [ReasoningTrace.model_validate(c["trace"]) for c in fixture],
        [c["text"] for c in fixture],
    )
    return out


def render(doc: dict[str, Any]) -> str:
    m, r, int8 = doc["machine"], doc["results"], doc["int8"]
    lines = [
        f"int8 vs float32 on {m['cpu']} ({m['nproc']} cores; {', '.join(m['cpu_flags'])}), "
        f"{m['date']}",
        f"int8 here: {int8['reason']}",
    ]
    if r is None:
        return "\n".join([*lines, "Nothing to compare: the service runs float32 on this CPU."])
    lines += [
        "",
        "| texts | float32 p50 / p99 | int8 p50 / p99 | int8 / float32 | "
        "two one-core runs: float32 / int8 | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for kind, s in r["speed"].items():
        lines.append(
            f"| {kind} | {s['float32_p50_ms']:.2f} / {s['float32_p99_ms']:.2f} ms | "
            f"{s['int8_p50_ms']:.2f} / {s['int8_p99_ms']:.2f} ms | {s['int8_per_text_ratio']:.2f}x | "
            f"{s['float32_two_one_core_runs_per_s']:.0f} / {s['int8_two_one_core_runs_per_s']:.0f}"
            f" texts/s | {s['int8_throughput_ratio']:.2f}x |"
        )
    lines += [
        "",
        "| corpus | traces | max score change | mean | > 0.005 | max max_cosine change | "
        "lowest vector cosine |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, d in r["deviation"].items():
        lines.append(
            f"| {name} | {d['traces']} | {d['max_score_change']:.4f} | "
            f"{d['mean_score_change']:.4f} | {d['over_0.005']} | "
            f"{d['max_max_cosine_change']:.4f} | {d['min_vector_cosine']:.4f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.precision", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="fewer texts: a smoke run")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON (default %(default)s)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    support = int8_support()
    doc = {
        "run": provenance(),
        "machine": machine(),
        "int8": {"weights": support.weights, "reason": support.reason},
        "quick": args.quick,
        "results": None if support.weights is None else measure(args.quick),
    }
    doc["duration_s"] = round(time.perf_counter() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(render(doc))
    print(f"\n{doc['duration_s']} s; written: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
