"""The repository is self-contained: nothing in it points to a file outside it. The contract
lives in docs/ (docs/scoring.md and the pages beside it), and code comments cite those pages."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Spelled in pieces, so that this file does not match itself.
OUTSIDE = re.compile(
    "|".join([r"\.\./" + "shared", "SPEC" + r"\.md", r"\bSPEC" + r"\s+(?:section\s+)?\d"])
)


def _tracked_text_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    files = []
    for name in filter(None, listed.split("\0")):
        path = ROOT / name
        if path.is_file() and path.stat().st_size < 2_000_000:
            try:
                path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            files.append(path)
    return files


def test_nothing_refers_to_a_brief_outside_the_repository() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in _tracked_text_files()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not found, "cite a docs page instead:\n" + "\n".join(found)


def test_the_pattern_finds_what_it_looks_for() -> None:
    assert OUTSIDE.search("see " + "../" + "shared/" + "SPEC" + ".md")
    assert OUTSIDE.search("(SPEC" + " section 8)")
    assert OUTSIDE.search("(SPEC" + " 6)")
    assert not OUTSIDE.search("SPECIAL_TOKENS")
