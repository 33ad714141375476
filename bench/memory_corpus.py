"""Real MiniLM vectors for the memory phase (bench.memory), embedded once and cached.

The text: docstrings of the Python files Debian's packages install (/usr/lib/python3.11, the
standard library, and /usr/lib/python3/dist-packages), read with `ast` (nothing imported), each
split into paragraphs; then the items of the Debian and upstream changelogs in /usr/share/doc
(`* ...` entries). Paragraphs of 40 to 400 characters, whitespace collapsed, deduplicated, in
a fixed order (sorted paths).

The vectors are the service's own (app.embedding.onnx_embedder, float32, the default mode) and
are cached outside the repository, in ~/.cache/kp-scoring/ (KP_BENCH_CACHE to move it), keyed
by the text's hash, so later runs load them in a second.

    python -m bench.memory_corpus [--count 100000]
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt

PART = 5_000
CACHE_DIR = Path(os.environ.get("KP_BENCH_CACHE", Path.home() / ".cache" / "kp-scoring"))
#: Paragraphs of a typical trace's length (about 10 to 100 tokens).
MIN_CHARS, MAX_CHARS = 40, 400
#: Modules that do something when imported (open windows, print, start tests) are skipped.
PYTHON_ROOTS = ("/usr/lib/python3.11", "/usr/lib/python3/dist-packages")
_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def python_paragraphs() -> Iterator[str]:
    """Docstring paragraphs of every module, class and function in Debian's Python files."""
    for root in PYTHON_ROOTS:
        for path in sorted(Path(root).rglob("*.py")):
            try:
                tree = ast.parse(path.read_bytes())
            except (SyntaxError, ValueError, OSError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, _DOCUMENTED):
                    doc = ast.get_docstring(node)
                    if doc:
                        yield from re.split(r"\n\s*\n", doc)


def changelog_paragraphs() -> Iterator[str]:
    """Each `* ...` item of the Debian and upstream changelogs in /usr/share/doc."""
    for path in sorted(Path("/usr/share/doc").glob("*/changelog*.gz")):
        try:
            text = gzip.decompress(path.read_bytes()).decode("utf-8", "replace")
        except (OSError, EOFError):
            continue
        yield from re.split(r"\n\s*[*+-] ", text)


def texts(count: int) -> list[str]:
    out: list[str] = []
    unique: set[str] = set()
    for source in (python_paragraphs(), changelog_paragraphs()):
        for paragraph in source:
            text = " ".join(paragraph.split())
            if MIN_CHARS <= len(text) <= MAX_CHARS and text not in unique:
                unique.add(text)
                out.append(text)
                if len(out) == count:
                    return out
    return out


def vectors(
    count: int, *, batch: int = 32, worker: tuple[int, int] = (0, 1)
) -> tuple[list[str], npt.NDArray[np.float32]]:
    """`count` texts and their MiniLM vectors (fewer if the sources run out). `worker`
    (i, n): embed only every n-th part, from the i-th, so n processes share the work; the
    vectors are returned once every part is there."""
    corpus = texts(count)
    key = hashlib.sha256("\n".join(corpus).encode()).hexdigest()[:16]
    path = CACHE_DIR / f"memory-{len(corpus)}-{key}.npy"
    if path.exists():
        return corpus, np.load(path)
    from app.embedding import model_files
    from app.embedding.onnx_embedder import OnnxEmbedder

    files = model_files.resolve(None, None)
    embedder = OnnxEmbedder(files.model, files.tokenizer, intra_op_threads=1)
    # Embedded PART texts at a time, each part saved as it is done: an interrupted run resumes.
    parts = CACHE_DIR / f"memory-{len(corpus)}-{key}.parts"
    parts.mkdir(parents=True, exist_ok=True)
    out = np.empty((len(corpus), 384), dtype=np.float32)
    started = time.monotonic()
    mine = range(worker[0] * PART, len(corpus), worker[1] * PART)
    # This worker's parts first, then the others' (waiting for the ones not done yet).
    for first in [*mine, *(f for f in range(0, len(corpus), PART) if f not in mine)]:
        part = parts / f"{first:07d}.npy"
        if first not in mine:
            while not part.exists():
                time.sleep(5)
        if part.exists():
            out[first : first + PART] = np.load(part)
            continue
        chunk = corpus[first : first + PART]
        # Similar lengths together: less padding, the same vectors.
        order = sorted(range(len(chunk)), key=lambda i: len(chunk[i]))
        vectors_of_part = np.empty((len(chunk), 384), dtype=np.float32)
        for start in range(0, len(order), batch):
            rows = order[start : start + batch]
            vectors_of_part[rows] = embedder.embed([chunk[i] for i in rows])
        tmp_part = part.with_suffix(".tmp.npy")
        np.save(tmp_part, vectors_of_part)
        os.replace(tmp_part, part)
        out[first : first + PART] = vectors_of_part
        done = first + len(chunk)
        print(f"embedded {done}/{len(corpus)} in {time.monotonic() - started:.0f} s", flush=True)
    if worker[0] != 0:
        return corpus, out  # the first worker writes the whole
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    path.with_name(path.name.removesuffix(".npy") + ".texts.json").write_text(json.dumps(corpus))
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, out)
    os.replace(tmp, path)
    return corpus, out


def saved(count: int) -> tuple[list[str], npt.NDArray[np.float32]] | None:
    """A finished embedding of `count` texts with its texts beside it (the packages' files
    may change later: an install adds changelogs, and the texts would no longer match)."""
    for path in sorted(CACHE_DIR.glob(f"memory-{count}-*.texts.json")):
        vectors_path = path.with_name(path.name.removesuffix(".texts.json") + ".npy")
        if vectors_path.exists():
            return json.loads(path.read_text()), np.load(vectors_path)
    return None


def available(count: int) -> tuple[list[str], npt.NDArray[np.float32]]:
    """The texts and vectors embedded so far (all `count` when done; else the parts done,
    from the first, in order), without embedding anything."""
    finished = saved(count)
    if finished is not None:
        return finished
    corpus = texts(count)
    key = hashlib.sha256("\n".join(corpus).encode()).hexdigest()[:16]
    path = CACHE_DIR / f"memory-{len(corpus)}-{key}.npy"
    if path.exists():
        return corpus, np.load(path)
    parts = CACHE_DIR / f"memory-{len(corpus)}-{key}.parts"
    done = []
    for first in range(0, len(corpus), PART):
        part = parts / f"{first:07d}.npy"
        if not part.exists():
            break
        done.append(np.load(part))
    if not done:
        return [], np.empty((0, 384), dtype=np.float32)
    vectors = np.concatenate(done)
    return corpus[: len(vectors)], vectors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--worker", default="0/1", help="i/n: this process's share of parts")
    args = parser.parse_args()
    i, n = (int(x) for x in args.worker.split("/"))
    corpus, v = vectors(args.count, worker=(i, n))
    print(f"{len(corpus)} texts, vectors {v.shape} in {CACHE_DIR}")


if __name__ == "__main__":
    main()
