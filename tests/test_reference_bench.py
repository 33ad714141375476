"""The bench's reference phase degrades to a clear message where the reference is not at hand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench import reference, reference_setup

ROOT = Path(__file__).resolve().parent.parent


def test_an_unprepared_folder_skips_the_phase_and_says_how_to_prepare_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KP_REFERENCE_DIR", str(tmp_path / "reference"))
    where = reference.available()
    assert isinstance(where, str)
    assert "python -m bench.reference_setup" in where or "node is not installed" in where


def test_setup_without_node_exits_0_saying_why_and_writes_nothing(tmp_path: Path) -> None:
    target = tmp_path / "reference"
    done = subprocess.run(
        [sys.executable, "-m", "bench.reference_setup", "--dir", str(target)],
        cwd=ROOT,
        env={"PATH": str(tmp_path), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0
    assert "node is not installed" in done.stderr
    assert not (target / reference_setup.READY).exists()


def test_a_missing_source_is_named(tmp_path: Path) -> None:
    with pytest.raises(reference_setup.UnavailableError, match=r"scoring\.ts not found"):
        reference_setup.fetch_source(tmp_path / "src", tmp_path / "nowhere", None, tmp_path)
