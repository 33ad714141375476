"""The model cache (app/embedding/session_cache.py): a start loads onnxruntime's optimised graph
from disk instead of making it again, with the same vectors bit for bit; an entry that is
stale or damaged is built again, never used; a directory that cannot be written leaves the
load as it is without a cache, and the service says so in its log."""

from __future__ import annotations

import asyncio
import json
import logging
import zlib
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from app.core.config import Settings, user_cache_directory
from app.embedding import model_files
from app.embedding.embeddings import EmbeddingService
from app.embedding.int8_support import int8_support
from app.embedding.onnx_embedder import OnnxEmbedder
from app.embedding.session_cache import SessionCache
from app.service.runtime import load_embedder

TEXTS = [
    "Review PR #42 for security issues Analyzing diff for injection vectors",
    "東京 café 😀",
    "",
    "the ledger balances after the third reconciliation " * 60,  # past the 512-token window
]
FILES = model_files.resolve(None, None)


def _embedder(cache: SessionCache | None, **kwargs: object) -> OnnxEmbedder:
    return OnnxEmbedder(
        FILES.model,
        FILES.tokenizer,
        session_cache=cache,
        model_sha256=lambda: model_files.PACKAGED_MODEL_SHA256,
        **kwargs,  # type: ignore[arg-type]
    )


def _vectors(embedder: OnnxEmbedder, one_core: bool = False) -> npt.NDArray[np.float32]:
    return np.vstack(
        [embedder.embed_tokenized(embedder.tokenize([t]), one_core=one_core) for t in TEXTS]
    )


@pytest.fixture(scope="module")
def uncached() -> npt.NDArray[np.float32]:
    """The vectors of a session made as without a cache."""
    return _vectors(_embedder(None))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache directory with the packaged model's entry written."""
    directory = tmp_path_factory.mktemp("model-cache")
    embedder = _embedder(SessionCache(directory))
    assert embedder.cache_outcome is not None
    assert (embedder.cache_outcome.state, embedder.cache_outcome.detail) == ("built", None)
    return directory


def _copy(directory: Path, to: Path) -> Path:
    to.mkdir()
    for f in directory.iterdir():
        (to / f.name).write_bytes(f.read_bytes())
    return to


def _entry(directory: Path) -> dict[str, Path]:
    (record,) = directory.glob("*.json")
    files = json.loads(record.read_text())["files"]
    return {
        "json": record,
        "onnx": directory / files["onnx"]["name"],
        "data": directory / files["data"]["name"],
    }


def test_a_cached_graph_gives_the_same_vectors_bit_for_bit(
    built: Path, uncached: npt.NDArray[np.float32]
) -> None:
    embedder = _embedder(SessionCache(built), concurrent_runs=2, defer=True)
    assert embedder.cache_outcome is not None
    assert embedder.cache_outcome.state == "loaded"
    np.testing.assert_array_equal(_vectors(embedder), uncached)
    embedder.finish_loading()  # the one-core session, from the same entry
    np.testing.assert_array_equal(_vectors(embedder, one_core=True), uncached)


def test_the_graph_is_folded_to_float32_and_kept_beside_its_record(built: Path) -> None:
    entry = _entry(built)
    # The int8 weights, folded: several times the model file's size; the graph itself small.
    assert entry["data"].stat().st_size > 3 * FILES.model.stat().st_size
    assert entry["onnx"].stat().st_size < FILES.model.stat().st_size / 10
    assert not list(built.glob(".building-*"))


def test_another_cpu_or_model_is_another_entry(built: Path, tmp_path: Path) -> None:
    directory = _copy(built, tmp_path / "cache")
    here = SessionCache(directory)
    elsewhere = SessionCache(directory, cpu_flags={"sse2"})
    assert here.key("a" * 64) != elsewhere.key("a" * 64)
    assert here.key("a" * 64) != here.key("b" * 64)
    embedder = _embedder(elsewhere)
    assert embedder.cache_outcome is not None
    assert embedder.cache_outcome.state == "built"
    assert len(list(directory.glob("*.json"))) == 2


@pytest.mark.parametrize(
    "damage",
    [
        "flip a weight",
        # Each builds the graph again (seconds): make test-fast keeps one kind of damage.
        *(
            pytest.param(damage, marks=pytest.mark.slow)
            for damage in (
                "truncate the data",
                "truncate the graph",
                "garble the record",
                "stale",
                "a record that vouches for a bad graph",
            )
        ),
    ],
)
def test_a_damaged_or_stale_entry_is_built_again_never_used(
    built: Path, tmp_path: Path, uncached: npt.NDArray[np.float32], damage: str
) -> None:
    directory = _copy(built, tmp_path / "cache")
    entry = _entry(directory)
    if damage == "flip a weight":
        with entry["data"].open("r+b") as f:
            f.seek(entry["data"].stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x40]))
    elif damage == "truncate the data":
        with entry["data"].open("r+b") as f:
            f.truncate(1000)
    elif damage == "truncate the graph":
        with entry["onnx"].open("r+b") as f:
            f.truncate(100)
    elif damage == "garble the record":
        entry["json"].write_text("{not json")
    elif damage == "stale":
        record = json.loads(entry["json"].read_text())
        entry["json"].write_text(json.dumps({**record, "format": 0}))
    else:  # whole by its record, refused by onnxruntime
        entry["onnx"].write_bytes(b"not a graph")
        record = json.loads(entry["json"].read_text())
        record["files"]["onnx"] |= {"size": 11, "crc32": zlib.crc32(b"not a graph")}
        entry["json"].write_text(json.dumps(record))
    embedder = _embedder(SessionCache(directory))
    assert embedder.cache_outcome is not None
    assert embedder.cache_outcome.state == "built"
    assert embedder.cache_outcome.detail is not None
    if damage.startswith("a record"):
        assert "refused by onnxruntime" in embedder.cache_outcome.detail
    np.testing.assert_array_equal(_vectors(embedder), uncached)
    # Written again, whole: the next start loads it, and no older data file is left.
    again = _embedder(SessionCache(directory))
    assert again.cache_outcome is not None
    assert again.cache_outcome.state == "loaded"
    assert len(list(directory.glob("*.data"))) == 1


def test_an_unwritable_directory_leaves_the_load_as_without_a_cache(
    tmp_path: Path, uncached: npt.NDArray[np.float32]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a directory cannot be made under it, even by root
    embedder = _embedder(SessionCache(blocker / "cache"))
    assert embedder.cache_outcome is not None
    assert embedder.cache_outcome.state == "unsaved"
    assert "cannot write" in (embedder.cache_outcome.detail or "")
    np.testing.assert_array_equal(_vectors(embedder), uncached)


def test_the_service_logs_an_unwritable_cache(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    settings = Settings(model_cache_dir=blocker / "cache")
    service = EmbeddingService(lambda: load_embedder(FILES, settings, None), model_name=None)

    async def load() -> None:
        await service.load()
        await service.close()

    with caplog.at_level(logging.INFO):
        asyncio.run(load())
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == [
        "model cache: the graph was optimised at this start, not saved"
    ]
    assert "cannot write" in warnings[0].reason  # type: ignore[attr-defined]
    (ready,) = [r for r in caplog.records if r.getMessage() == "embedder ready"]
    assert ready.model_cache == "unsaved"  # type: ignore[attr-defined]


def test_the_cache_can_be_turned_off(tmp_path: Path) -> None:
    settings = Settings(model_cache=False, model_cache_dir=tmp_path / "cache")
    embedder = load_embedder(FILES, settings, None)
    assert embedder.cache_outcome is None
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow  # an int8 graph built (seconds)
def test_int8_mode_has_entries_of_its_own_with_the_same_vectors(
    built: Path, tmp_path: Path
) -> None:
    support = int8_support()
    if support.weights is None:
        pytest.skip(f"int8 mode declined on this CPU: {support.reason}")
    directory = _copy(built, tmp_path / "cache")
    plain = _embedder(None, precision="int8", int8_weights=support.weights)
    first = _embedder(SessionCache(directory), precision="int8", int8_weights=support.weights)
    again = _embedder(SessionCache(directory), precision="int8", int8_weights=support.weights)
    assert first.cache_outcome is not None
    assert again.cache_outcome is not None
    # The rewritten graph's bytes, not the file's, name the entry: not the float32 one.
    assert (first.cache_outcome.state, again.cache_outcome.state) == ("built", "loaded")
    np.testing.assert_array_equal(_vectors(again), _vectors(plain))


def test_the_cache_directory_is_the_user_cache_or_none(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert user_cache_directory() == tmp_path / "kp-scoring" / "onnx"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert user_cache_directory() == tmp_path / "home" / ".cache" / "kp-scoring" / "onnx"

    def unknown() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", unknown)
    assert user_cache_directory() is None  # no cache rather than a shared place such as /tmp


def test_a_session_loaded_from_the_cache_does_not_read_the_model(
    built: Path, tmp_path: Path, uncached: npt.NDArray[np.float32]
) -> None:
    directory = _copy(built, tmp_path / "cache")
    absent = tmp_path / "model.onnx"  # its sha256 is checked by the caller (model_files.verify)
    embedder = OnnxEmbedder(
        absent,
        FILES.tokenizer,
        session_cache=SessionCache(directory),
        model_sha256=lambda: model_files.PACKAGED_MODEL_SHA256,
        concurrent_runs=2,
    )
    assert embedder.cache_outcome is not None
    assert embedder.cache_outcome.state == "loaded"
    np.testing.assert_array_equal(_vectors(embedder), uncached)
    np.testing.assert_array_equal(_vectors(embedder, one_core=True), uncached)
