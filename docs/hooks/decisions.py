"""mkdocs hook: the decision records' list on docs/decisions/index.md, made from the files.

Every `docs/decisions/<slug>.md` but the index is listed with its title (its first `# `
line), so a new record needs no edit of the index or the nav.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MARKER = "<!-- decision-records -->"


def records(directory: Path) -> list[tuple[str, str]]:
    """(file name, title) of each record, sorted by title."""
    found = []
    for path in sorted(directory.glob("*.md")):
        if path.name == "index.md":
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        title = next((line[2:].strip() for line in lines if line.startswith("# ")), path.stem)
        found.append((path.name, title))
    return sorted(found, key=lambda record: record[1].lower())


def render(directory: Path) -> str:
    return "\n".join(f"- [{title}]({name})" for name, title in records(directory))


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri != "decisions/index.md":
        return markdown
    return markdown.replace(MARKER, render(Path(config["docs_dir"]) / "decisions"))
