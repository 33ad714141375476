"""Writes app/embedding/assets/int8_float_channels.json: the input channels int8 mode keeps in
float32, for the packaged model.

    python scripts/calibrate_int8.py [--check]

Runs the float32 model on a calibration set (bench corpus seeds 3 and 4: 40 typical and 4 long
traces, disjoint from the texts the benchmark and the tests measure with), records each weight
MatMul's largest absolute input per channel, and keeps the two largest channels of every weight
MatMul but the attention output projections (their inputs have no such outliers). `--check`
exits 1 if the asset differs from what this run computes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from app.embedding import int8_activations, model_files
from app.embedding.onnx_embedder import OnnxEmbedder
from bench import corpus

ASSET = Path(int8_activations.__file__).parent / "assets" / int8_activations.FLOAT_CHANNELS_ASSET
CHANNELS_PER_MATMUL = 2


def calibrate() -> dict[str, Any]:
    files = model_files.resolve(None, None)
    raw = files.model.read_bytes()
    model = onnx.load_from_string(raw)
    matmuls = int8_activations.weight_matmuls(model)
    # Six per layer in graph order: Q, K, V, attention output, FFN in, FFN out.
    if len(matmuls) != 36:
        raise SystemExit(f"expected 36 weight MatMuls (6 layers x 6), found {len(matmuls)}")
    kept = [m for i, m in enumerate(matmuls) if i % 6 != 3]
    inputs = sorted({m.input[0] for m in kept})
    model.graph.output.extend(onnx.ValueInfoProto(name=name) for name in inputs)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options)

    embedder = OnnxEmbedder(files.model, files.tokenizer, intra_op_threads=1)
    items = corpus.build("typical", 40, seed=3) + corpus.build("long", 4, seed=4)
    peak = {name: np.zeros(0, dtype=np.float32) for name in inputs}
    for tokens in embedder.tokenize([item.text for item in items]):
        ids = np.asarray([tokens.ids], dtype=np.int64)
        feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        feed["token_type_ids"] = np.zeros_like(ids)
        for name, value in zip(inputs, session.run(inputs, feed), strict=True):
            channel_max = np.abs(value.reshape(-1, value.shape[-1])).max(axis=0)
            peak[name] = np.maximum(peak[name], channel_max) if peak[name].size else channel_max
    channels = {
        m.name: [int(c) for c in np.argsort(-peak[m.input[0]])[:CHANNELS_PER_MATMUL]] for m in kept
    }
    return {
        "model_sha256": hashlib.sha256(raw).hexdigest(),
        "made_by": "scripts/calibrate_int8.py (bench corpus seeds 3 and 4, top 2 per MatMul)",
        "float_channels": channels,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the asset only")
    args = parser.parse_args()
    table = calibrate()
    text = json.dumps(table, indent=1) + "\n"
    if args.check:
        same = ASSET.read_text() == text
        print(f"{ASSET}: {'up to date' if same else 'DIFFERS from a fresh calibration'}")
        raise SystemExit(0 if same else 1)
    ASSET.write_text(text)
    print(f"wrote {ASSET}: channels for {len(table['float_channels'])} MatMuls")


if __name__ == "__main__":
    main()
