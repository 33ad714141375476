"""README.md is the front door: short, its links lead into the docs, its two commands and its
example are there (tests/test_examples.py runs the example and compares its answer)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.doc_examples import blocks

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TEXT = README.read_text(encoding="utf-8")


def test_the_readme_is_short() -> None:
    assert len(TEXT.splitlines()) <= 200


def test_the_readme_shows_the_two_commands_and_runs_its_curl() -> None:
    shown = [b for b in blocks(README) if b.language == "console"]
    commands = "\n".join(b.text for b in shown)
    assert "$ make run" in commands
    assert "$ make test" in commands
    (curl,) = [b for b in shown if "curl" in b.text]
    assert curl.mark == "run"
    assert "-d @examples/trace.json" in curl.text


def test_the_readme_shows_the_client_from_its_own_package() -> None:
    (python,) = [b for b in blocks(README) if b.language == "python"]
    assert "from kp_scoring import KpScoringClient" in python.text
    assert python.mark == "run"
    assert python.output is not None
    assert "pip install ./clients/python" in TEXT
    assert "pip install kp-scoring\n" not in TEXT  # no registry serves it


def test_every_link_of_the_readme_leads_to_a_file() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", TEXT)
    local = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in local)
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing


def test_the_readme_links_every_page_of_the_docs_nav() -> None:
    nav = re.findall(r":\s*([\w/-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    linked = set(re.findall(r"\(docs/([\w/-]+\.md)", TEXT))
    assert set(nav) - {"index.md"} <= linked, set(nav) - linked


def test_the_readme_has_no_performance_figures() -> None:
    """Figures belong to docs/performance.md, where they are rendered from bench/results."""
    assert not re.search(r"\d\s?(ms|µs|us|req/s|/s)\b", TEXT), "figures in the README"
