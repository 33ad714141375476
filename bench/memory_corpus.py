"""Real MiniLM vectors for the memory phase (bench.memory), embedded once and cached.

The text: docstrings of the Python files Debian's packages install (/usr/lib/python3.11, the
standard library, and /usr/lib/python3/dist-packages), read with `ast` (nothing imported), each
split into paragraphs; then the items of the Debian and upstream changelogs in /usr/share/doc
(`* ...` entries). Paragraphs of 40 to 2,000 characters, whitespace collapsed, deduplicated, in
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
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt

CACHE_DIR = Path(os.environ.get("KP_BENCH_CACHE", Path.home() / ".cache" / "kp-scoring"))
MIN_CHARS, MAX_CHARS = 40, 2000
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


def vectors(count: int, *, batch: int = 32) -> tuple[list[str], npt.NDArray[np.float32]]:
    """`count` texts and their MiniLM vectors (fewer if the sources run out)."""
    corpus = texts(count)
    key = hashlib.sha256("\n".join(corpus).encode()).hexdigest()[:16]
    path = CACHE_DIR / f"memory-{len(corpus)}-{key}.npy"
    if path.exists():
        return corpus, np.load(path)
    from app.embedding import model_files
    from app.embedding.onnx_embedder import OnnxEmbedder

    files = model_files.resolve(None, None)
    embedder = OnnxEmbedder(files.model, files.tokenizer, intra_op_threads=1)
    # Similar lengths together: less padding, the same vectors.
    order = sorted(range(len(corpus)), key=lambda i: len(corpus[i]))
    out = np.empty((len(corpus), 384), dtype=np.float32)
    started = time.monotonic()
    for n, start in enumerate(range(0, len(order), batch)):
        rows = order[start : start + batch]
        out[rows] = embedder.embed([corpus[i] for i in rows])
        if n % 200 == 0:
            print(
                f"embedded {start + len(rows)}/{len(order)} in {time.monotonic() - started:.0f} s",
                flush=True,
            )
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, out)
    os.replace(tmp, path)
    return corpus, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100_000)
    args = parser.parse_args()
    corpus, v = vectors(args.count)
    print(f"{len(corpus)} texts, vectors {v.shape} in {CACHE_DIR}")


if __name__ == "__main__":
    main()
