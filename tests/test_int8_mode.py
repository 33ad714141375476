"""KP_EMBEDDER_PRECISION=int8: the real model on int8 activations, held to the 0.01 bound.

The bound is checked against the reference SDK's own scores (tests/fixtures/reference): every
trace of the embedder sequence, in order, through the service in int8 mode.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from app.embedding import int8_activations, model_files
from app.embedding.onnx_embedder import MAX_TOKENS, OnnxEmbedder
from tests.conftest import ClientFactory, load_fixture
from tests.factories import make_trace

SEQUENCE = load_fixture("embedder_sequence.json")["cases"]
REFERENCE = np.asarray([case["embedding"] for case in SEQUENCE], dtype=np.float32)
#: The issue's bound on how far int8 mode may move a score.
MAX_SCORE_CHANGE = 0.01


@pytest.fixture(scope="module")
def int8_embedder() -> OnnxEmbedder:
    files = model_files.resolve(None, None)
    return OnnxEmbedder(files.model, files.tokenizer, concurrent_runs=2, precision="int8")


def test_sequence_scores_stay_within_001_of_the_reference(make_client: ClientFactory) -> None:
    client = make_client(embedder_precision="int8")
    changes = []
    for case in SEQUENCE:
        body = client.post("/evaluate", json=case["trace"]).json()
        changes.append(abs(body["score"] - case["expected_score"]))
        assert body["novelty"]["tokens"] == min(case["token_count"], MAX_TOKENS)
        assert body["novelty"]["truncated"] == (case["token_count"] > MAX_TOKENS)
        if case["max_cosine_before"] is not None:
            assert body["novelty"]["measured"] is True
            assert body["novelty"]["max_cosine"] == pytest.approx(
                case["max_cosine_before"], abs=0.03
            )
    assert max(changes) < MAX_SCORE_CHANGE, f"largest score change {max(changes):.4f}"
    embedder = client.get("/readyz").json()["embedder"]
    assert (embedder["state"], embedder["precision"]) == ("ready", "int8")


def test_int8_vectors_are_close_to_the_reference_but_not_float32(
    int8_embedder: OnnxEmbedder,
) -> None:
    vectors = np.vstack([int8_embedder.embed([case["text"]]) for case in SEQUENCE])
    cosines = (vectors.astype(np.float64) * REFERENCE).sum(axis=1)
    assert cosines.min() > 0.995
    # int8 arithmetic really ran: float32 equals the reference to 2e-6 (test_reference.py).
    assert np.abs(vectors - REFERENCE).max() > 1e-4
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)


def test_a_text_gets_the_same_vector_alone_in_a_batch_or_on_one_core(
    int8_embedder: OnnxEmbedder,
) -> None:
    """The activations' scale covers a whole run, so int8 mode gives each text its own run."""
    texts = ["short", "a somewhat longer sentence about ledgers", "word " * 300, "東京 café"]
    alone = np.vstack([int8_embedder.embed([text]) for text in texts])
    tokenized = int8_embedder.tokenize(texts)
    np.testing.assert_array_equal(int8_embedder.embed(texts), alone)
    np.testing.assert_array_equal(int8_embedder.embed_tokenized(tokenized, one_core=True), alone)


def test_the_rewrite_uses_the_shipped_int8_weights() -> None:
    source = onnx.load(model_files.packaged_model())
    rewritten = onnx.load_from_string(
        int8_activations.int8_activation_model(model_files.packaged_model().read_bytes())
    )
    onnx.checker.check_model(rewritten)
    shipped = {t.name: t for t in source.graph.initializer}
    kept = {t.name: t for t in rewritten.graph.initializer}
    int8_nodes = [n for n in rewritten.graph.node if n.op_type == "DynamicQuantizeMatMul"]
    assert len(int8_nodes) == 36  # 6 layers x (Q, K, V, attention output, FFN in, FFN out)
    for node in int8_nodes:
        weight = node.input[1]
        assert kept[weight].data_type == onnx.TensorProto.INT8
        assert kept[weight].SerializeToString() == shipped[weight].SerializeToString()
    table = int8_activations.float_channel_table()["float_channels"]
    float_products = {n.name for n in rewritten.graph.node if n.name.endswith("_float")}
    assert float_products == {f"{name}_float" for name in table}
    assert len(table) == 30


def test_the_channel_table_is_what_the_calibration_script_makes() -> None:
    script = Path(__file__).parents[1] / "scripts" / "calibrate_int8.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_another_model_is_refused_in_int8_mode_and_says_why(
    make_client: ClientFactory, tmp_path: Path
) -> None:
    other = tmp_path / "model.onnx"
    shutil.copyfile(model_files.packaged_model(), other)
    with other.open("ab") as f:  # still a valid protobuf: a field the parser skips
        f.write(bytes([0xFA, 0x7F, 0x01, 0x00]))
    client = make_client(model_path=other, embedder_precision="int8")
    body = client.post("/evaluate", json=make_trace()).json()
    assert body["novelty"]["measured"] is False
    embedder = client.get("/readyz").json()["embedder"]
    assert embedder["state"] == "unavailable"
    assert "KP_EMBEDDER_PRECISION" in embedder["reason"]
    assert "calibrated for the packaged model" in embedder["reason"]


def test_int8_and_float32_snapshots_are_kept_apart(
    make_client: ClientFactory, tmp_path: Path
) -> None:
    path = tmp_path / "cache.snapshot"
    first = make_client(cache_snapshot_path=path, embedder_precision="int8")
    first.post("/evaluate", json=make_trace(objective="alpha topic"))
    first.__exit__(None, None, None)  # shutdown saves
    second = make_client(cache_snapshot_path=path)  # float32
    assert second.get("/readyz").json()["snapshot"]["state"] == "set_aside"
    assert second.get("/cache").json()["size"] == 0
    assert len(list(tmp_path.glob("cache.snapshot.other_model-*"))) == 1


def test_precision_is_reported_and_checked(make_client: ClientFactory) -> None:
    default = make_client()
    assert default.get("/cache").json()["embedder"]["precision"] == "float32"
    assert make_client(embedder="none").get("/cache").json()["embedder"]["precision"] is None
