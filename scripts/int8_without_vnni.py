"""int8 mode on an emulated CPU without VNNI: how far each weight type moves the reference
fixtures' scores there.

    python scripts/int8_without_vnni.py [--cases 0-63] [--weights int8 uint8]

valgrind (Debian package `valgrind`) emulates an x86-64 CPU with AVX2 but neither AVX-512 nor
VNNI, so onnxruntime inside it picks the kernels such a CPU gets (the u8 x s8 one saturates in
16 bits, app/embedding/int8_support.py). For each weight type the embedder runs the fixture
texts under valgrind, one text per run as the service does; the vectors are then scored here,
natively, in order through the service's Evaluator, and compared with the reference's. Slow:
about 1 s per short text and 1-2 min per 512-token one (all 125 cases: 30-60 min per type).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from app.embedding import model_files
from app.embedding.embeddings import EmbeddingService
from app.embedding.onnx_embedder import OnnxEmbedder
from app.embedding.token_window import Window
from app.memory.in_process import InProcessMemory
from app.schemas.trace import ReasoningTrace
from app.service.evaluator import Evaluator

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests/fixtures/reference/embedder_sequence.json"


def embed(weights: str, texts_file: Path, out: Path) -> None:
    """Runs inside valgrind: the texts' int8 vectors, as the service's embedder makes them."""
    files = model_files.resolve(None, None)
    embedder = OnnxEmbedder(
        files.model, files.tokenizer, intra_op_threads=1, precision="int8", int8_weights=weights
    )
    texts = json.loads(texts_file.read_text())
    vectors = []
    for i, text in enumerate(texts):
        vectors.append(embedder.embed([text])[0])
        print(f"  {weights}: {i + 1}/{len(texts)}", file=sys.stderr, flush=True)
    np.save(out, np.vstack(vectors))


class StoredVectors:
    """An embedder that answers with vectors computed elsewhere (the warm-up text: zeros)."""

    def __init__(self, real: OnnxEmbedder, texts: Sequence[str], vectors: npt.NDArray[Any]):
        self._real = real
        windows = real.tokenize(texts)
        self._by_window = {tuple(t.ids): v for t, v in zip(windows, vectors, strict=True)}

    cache_outcome = None  # what EmbeddingService reads of a loaded embedder
    embed_grouped = OnnxEmbedder.embed_grouped

    def finish_loading(self) -> None:
        pass

    def tokenize(self, texts: Sequence[str]) -> list[Window]:
        return self._real.tokenize(texts)

    def embed_tokenized(
        self, batch: Sequence[Window], *, one_core: bool = False
    ) -> npt.NDArray[np.float32]:
        zeros = np.zeros(self._real.dimensions, dtype=np.float32)
        return np.vstack([self._by_window.get(tuple(t.ids), zeros) for t in batch])


def scores(embedder: Any, traces: list[ReasoningTrace]) -> list[float]:
    async def run() -> list[float]:
        service = EmbeddingService(lambda: embedder, model_name="stored", workers=1)
        await service.load()
        evaluator = Evaluator(InProcessMemory(1000), service)
        out = []
        for trace in traces:
            (evaluation,) = await evaluator.evaluate([trace])
            out.append(evaluation.score.value)
        await service.close()
        return out

    return asyncio.run(run())


def case_range(spec: str, count: int) -> list[int]:
    if spec == "all":
        return list(range(count))
    first, _, last = spec.partition("-")
    return list(range(int(first), int(last or first) + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="all", help="fixture cases, e.g. 0-63 (default all)")
    parser.add_argument("--weights", nargs="+", default=["int8", "uint8"])
    parser.add_argument("--embed", nargs=3, metavar=("WEIGHTS", "TEXTS", "OUT"), help="internal")
    args = parser.parse_args()
    if args.embed:
        embed(args.embed[0], Path(args.embed[1]), Path(args.embed[2]))
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    cases = json.loads(FIXTURE.read_text())["cases"]
    chosen = [cases[i] for i in case_range(args.cases, len(cases))]
    texts = [c["text"] for c in chosen]
    traces = [ReasoningTrace.model_validate(c["trace"]) for c in chosen]
    reference = np.asarray([c["embedding"] for c in chosen], dtype=np.float64)
    files = model_files.resolve(None, None)
    native = OnnxEmbedder(files.model, files.tokenizer)
    expected = np.asarray(scores(StoredVectors(native, texts, reference), traces))
    with tempfile.TemporaryDirectory() as tmp:
        texts_file = Path(tmp) / "texts.json"
        texts_file.write_text(json.dumps(texts))
        for weights in args.weights:
            out = Path(tmp) / f"{weights}.npy"
            command = ["valgrind", "--tool=none", "-q", sys.executable, __file__]
            command += ["--embed", weights, str(texts_file), str(out)]
            subprocess.run(command, check=True)
            vectors = np.load(out)
            got = scores(StoredVectors(native, texts, vectors), traces)
            change = np.abs(np.asarray(got) - expected)
            cosines = (vectors.astype(np.float64) * reference).sum(axis=1)
            print(
                f"{weights} weights without VNNI, {len(chosen)} cases: largest score change "
                f"{change.max():.4f} (mean {change.mean():.4f}, {(change >= 0.01).sum()} at 0.01 "
                f"or more); lowest cosine with the reference's vectors {cosines.min():.4f}"
            )


if __name__ == "__main__":
    main()
