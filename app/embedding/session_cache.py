"""onnxruntime's optimised graph of the model, kept on disk and loaded as it is with the
optimisations off (docs/decisions/model-graph-cache.md). Keyed by the CPU too: a constant
folded by one CPU's kernels may differ in its last bits on another. Checked by CRC-32, not
SHA-256: it catches damage at under half the cost, and whoever could forge a file here could
rewrite its record."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import onnxruntime as ort

#: Bumped when the layout of an entry changes: older entries are then stale.
FORMAT: Final = 1
#: The level the graph is made at (onnx_embedder explains the choice).
LEVEL: Final = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
#: Initializers of this size or more go to the data file (all the weights; small constants
#: such as shapes stay in the graph).
_EXTERNAL_MIN_BYTES: Final = 1024
PROVIDERS: Final = ["CPUExecutionProvider"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """How the session came to be: `loaded` from the cache; `built` from the model and
    written to the cache; `unsaved`: built from the model, the cache not written (`detail`
    says why). `detail` also says why an entry found was not used (stale or damaged)."""

    state: Literal["loaded", "built", "unsaved"]
    detail: str | None = None


class SessionCache:
    """Entries in `directory`, each three files named by its key: KEY.onnx (the graph),
    KEY-NONCE.data (its initializers, named by the graph), KEY.json (the record of both,
    written last: an entry without it is unfinished). `cpu_flags`: the CPU the graphs are
    for (default: this machine's)."""

    def __init__(self, directory: Path, cpu_flags: Iterable[str] | None = None) -> None:
        self.directory = directory
        if cpu_flags is None:
            from app.embedding.int8_support import CpuFeatures

            cpu_flags = CpuFeatures.of_this_machine().flags
        self._cpu = sorted(cpu_flags)

    def key(self, model_sha256: str) -> str:
        """What a cached graph depends on, hashed to a file name."""
        what = {
            "format": FORMAT,
            "model_sha256": model_sha256,
            "onnxruntime": ort.__version__,
            "level": int(LEVEL),
            "cpu": self._cpu,
        }
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]

    def session(
        self,
        model: Callable[[], bytes],
        model_sha256: str,
        options: Callable[[], ort.SessionOptions],
    ) -> tuple[ort.InferenceSession, Outcome]:
        """A session of the model `model()` reads made at LEVEL, with the other settings of
        `options()`: loaded from a whole entry (the model is not read then), else built and
        written. onnxruntime's errors on the model itself propagate, as without a cache."""
        key = self.key(model_sha256)
        checks, why_not = self._record(key)
        if checks is not None:
            loaded = options()
            loaded.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            # The files' checksums are computed while onnxruntime loads them: the checksums
            # leave the GIL and the load mostly holds it, so on a second core they cost the
            # start no time. The session is used only once they match.
            with ThreadPoolExecutor(1, thread_name_prefix="kp-graph-check") as pool:
                checked = pool.submit(self._whole, checks)
                try:
                    session: ort.InferenceSession | None = ort.InferenceSession(
                        str(self.directory / f"{key}.onnx"), loaded, providers=PROVIDERS
                    )
                except Exception as exc:  # onnxruntime refuses the entry: built again below
                    session = None
                    why_not = f"cached graph refused by onnxruntime: {exc}"
                damage = checked.result()
            if damage is not None:
                why_not = damage
            elif session is not None:
                return session, Outcome("loaded")
        return self._build(model(), key, options, why_not)

    def _build(
        self, model: bytes, key: str, options: Callable[[], ort.SessionOptions], why_not: str | None
    ) -> tuple[ort.InferenceSession, Outcome]:
        # Only a start that writes the cache needs these (about 10 ms of imports).
        import secrets
        import shutil
        import tempfile

        def built(graph: Path | None = None, data_name: str = "") -> ort.InferenceSession:
            """The session made at LEVEL; with `graph`, the optimised graph written there and
            its initializers to `data_name` beside it."""
            made = options()
            made.graph_optimization_level = LEVEL
            if graph is not None:
                made.optimized_model_filepath = str(graph)
                prefix = "session.optimized_model_external_initializers_"
                made.add_session_config_entry(prefix + "file_name", data_name)
                made.add_session_config_entry(
                    prefix + "min_size_in_bytes", str(_EXTERNAL_MIN_BYTES)
                )
            return ort.InferenceSession(model, made, providers=PROVIDERS)

        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".building-", dir=self.directory))
        except OSError as exc:
            return built(), Outcome("unsaved", _joined(why_not, f"cannot write {exc}"))
        # The graph names its data file: a name of its own per write, so that a graph and the
        # data of another write of the same entry can never be loaded together.
        data_name = f"{key}-{secrets.token_hex(6)}.data"
        try:
            try:
                session = built(staging / f"{key}.onnx", data_name)
            except Exception:
                # Not the model's fault when writing the graph is what failed (a full disk):
                # the model is tried as without a cache, whose error (if any) is the one raised.
                return built(), Outcome("unsaved", _joined(why_not, "writing the graph failed"))
            try:
                self._publish(key, staging, data_name)
            except OSError as exc:
                return session, Outcome("unsaved", _joined(why_not, f"cannot write {exc}"))
            return session, Outcome("built", why_not)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _publish(self, key: str, staging: Path, data_name: str) -> None:
        """Moves the new graph in, data first, record last (renames: a reader never sees a
        half-written file under an entry's name), then removes the data of earlier writes."""
        files = {"data": data_name, "onnx": f"{key}.onnx"}
        record: dict[str, Any] = {"format": FORMAT, "key": key, "files": {}}
        for part, name in files.items():
            written = staging / name
            size = written.stat().st_size
            record["files"][part] = {"name": name, "size": size, "crc32": _crc32(written)}
            os.replace(written, self.directory / name)
        draft = staging / f"{key}.json"
        draft.write_text(json.dumps(record))
        os.replace(draft, self.directory / f"{key}.json")
        for old in self.directory.glob(f"{key}-*.data"):
            if old.name != data_name:
                # A load that has it open keeps reading it; one that opens it now fails, and
                # builds the graph again.
                old.unlink(missing_ok=True)

    def _record(self, key: str) -> tuple[list[tuple[Path, object]] | None, str | None]:
        """The files of entry `key` and the CRC-32 its record gives each, when the record is
        there, of this format and the files' sizes match it; else None, and why not (None: no
        entry)."""
        try:
            record = json.loads((self.directory / f"{key}.json").read_text())
            files: dict[str, Any] = record["files"]
            wanted = (FORMAT, key, f"{key}.onnx")
            if (record.get("format"), record.get("key"), files["onnx"]["name"]) != wanted:
                return None, "stale cached graph"
            checks: list[tuple[Path, object]] = []
            for part in ("onnx", "data"):
                expected = files[part]
                path = self.directory / Path(expected["name"]).name
                if path.stat().st_size != expected["size"]:
                    return None, f"damaged cached graph ({path.name})"
                checks.append((path, expected["crc32"]))
        except FileNotFoundError:
            return None, None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return None, f"unreadable cached graph: {exc}"
        return checks, None

    @staticmethod
    def _whole(checks: list[tuple[Path, object]]) -> str | None:
        """None when the files' CRC-32s match their record's, else what is wrong."""
        for path, crc in checks:
            try:
                if _crc32(path) != crc:
                    return f"damaged cached graph ({path.name})"
            except OSError as exc:
                return f"unreadable cached graph: {exc}"
        return None


@contextmanager
def mapped(path: Path) -> Iterator[mmap.mmap | bytes]:
    """A model file's bytes for hashing and checksums, mapped read-only (an empty file, which
    cannot be mapped: b""); OSError as `open` raises it. Mapped, hashlib and zlib leave the GIL
    for the whole call: read a chunk at a time, every retake of the GIL waited for the loading
    thread, and the checks that run beside the session's load took several times their CPU."""
    with path.open("rb", buffering=0) as f:
        if os.fstat(f.fileno()).st_size == 0:
            yield b""
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            yield view


def _crc32(path: Path) -> int:
    with mapped(path) as data:
        return zlib.crc32(data)


def _joined(first: str | None, second: str) -> str:
    return second if first is None else f"{first}; {second}"
