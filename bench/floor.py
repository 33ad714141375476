"""The floor: the same texts through a bare onnxruntime session, one at a time.

Same model file as the service (`model_files.resolve(None, None).model`), default
SessionOptions, the bundled tokenizer.json with the `tokenizers` library, cut at 512 tokens.
Each timed step is what any embedding needs: tokenize, run, mean-pool, normalise. Nothing
else (no HTTP, no JSON, no validation, no queue, no cache) is in it.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from app.embedding import model_files
from bench.stats import latency_summary, median_of_runs

WINDOW = 512


class Floor:
    def __init__(self) -> None:
        files = model_files.resolve(None, None)
        self.tokenizer = Tokenizer.from_file(str(files.tokenizer))
        self.tokenizer.enable_truncation(WINDOW)
        self.tokenizer.no_padding()
        self.session = ort.InferenceSession(str(files.model), providers=["CPUExecutionProvider"])

    def embed(self, text: str) -> np.ndarray[Any, np.dtype[np.float32]]:
        ids = np.asarray([self.tokenizer.encode(text).ids], dtype=np.int64)
        mask = np.ones_like(ids)
        (hidden,) = self.session.run(
            ["last_hidden_state"],
            {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)},
        )
        pooled = hidden[0].mean(axis=0)
        unit: np.ndarray[Any, np.dtype[np.float32]] = pooled / np.linalg.norm(pooled)
        return unit

    def measure(self, texts: list[str], warmup: list[str]) -> dict[str, float]:
        """Per-text latency percentiles and the one-at-a-time throughput over `texts`."""
        for text in warmup:
            self.embed(text)
        times = []
        cpu = time.process_time()
        started = time.perf_counter()
        for text in texts:
            t0 = time.perf_counter()
            self.embed(text)
            times.append((time.perf_counter() - t0) * 1000)
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu
        return {
            **latency_summary(times),
            "throughput_rps": len(texts) / elapsed,
            "cpu_ms_per_text": cpu * 1000 / len(texts),
        }


#: The figures whose spread over the floor's samples the report shows.
SPREAD_FIGURES = ("p50_ms", "throughput_rps")


def combine(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The floor measured several times, alternating with the service's phases so that a host
    whose speed moves during the run moves both sides of a ratio: each figure's median, and
    `spread` (min, max, (max - min) / median in %) of the main ones."""
    floor: dict[str, Any] = median_of_runs(samples)
    spread: dict[str, Any] = {"samples": len(samples)}
    for kind in ("typical", "long"):
        spread[kind] = {}
        for figure in SPREAD_FIGURES:
            values = [s[kind][figure] for s in samples]
            middle = floor[kind][figure]
            spread[kind][figure] = {
                "min": min(values),
                "max": max(values),
                "spread_pct": 100 * (max(values) - min(values)) / middle,
            }
    floor["spread"] = spread
    return floor
