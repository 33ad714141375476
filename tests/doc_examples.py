"""The examples of README.md and docs/: found, run, and their shown output compared.

The convention (docs/contributing.md, "Examples that run"): an HTML comment on the line
before a fenced block says what the tests do with it.

- `<!-- run -->` before a `console` block: each `$ ` line (with its `\\`-continued lines) runs
  in one bash session at the repository's root, stdout and stderr together; the lines up to
  the next `$ ` are its output, compared with what it printed.
- `<!-- run -->` before a `bash` or `python` block: the block runs as a script (bash, or this
  interpreter); a block marked `<!-- output -->` right after it is its expected output, and
  without one it must exit 0.
- `<!-- run: OPTION ... -->`: `requires=MODULE` (skipped while MODULE cannot be imported),
  `node` (a `js` block, run with node inside clients/typescript), `file` (a block that shows
  a file of examples/ with the snippets line `--8<-- "examples/NAME"`: the file runs, by
  its suffix, and prints its `.out` file beside it byte for byte, or else the `# ` (`// `)
  comment lines that end it).
- `<!-- not run: WHY -->`: shown only (a command that serves forever, installs, or needs
  Docker). Every `console`, `bash`, `sh`, `python` and `js` block carries one of the two.

The pages run in the order a reader meets them (`reading_order`: README.md, then the site's
nav, then the pages the nav does not list) against one server whose memory is never emptied
between pages: a page that needs another state says so and sets it.

Outputs are compared after two normalisations only: `http://127.0.0.1:8000` stands for the
live server the tests start (default settings); output that is JSON is compared as JSON, with
times (`elapsed_ms`, `age_ms`, ...) left out and floats within 1e-6 (another CPU rounds the
model's last bits differently); in text, `...` matches anything.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHOWN_URL = "http://127.0.0.1:8000"
RUN_LANGUAGES = {"console", "bash", "sh", "shell", "python", "js"}
#: Keys whose values are times or moments: they vary from run to run.
VOLATILE_KEYS = {"elapsed_ms", "age_ms", "oldest_age_ms", "newest_age_ms", "iat", "ts"}

_MARK = re.compile(r"<!--\s*(run|not run|output)\s*(?::\s*(.*?))?\s*-->\s*$")
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    text: str
    mark: str | None = None  # "run", "not run", "output"
    options: list[str] = field(default_factory=list)
    output: Block | None = None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def option(self, name: str) -> str | None:
        for option in self.options:
            key, _, value = option.partition("=")
            if key == name:
                return value or key
        return None


_NAV_PAGE = re.compile(r"^\s*-\s+(?:[^:\n]+:\s+)?([\w/.-]+\.md)\s*$", re.MULTILINE)


def pages() -> list[Path]:
    """README.md and every page of the docs site, in the order a reader meets them: the README,
    the site's nav (mkdocs.yml), then the pages the nav does not list (decision records)."""
    nav = _NAV_PAGE.findall((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    listed = [ROOT / "docs" / page for page in nav]
    rest = [p for p in sorted((ROOT / "docs").rglob("*.md")) if p not in listed]
    return [ROOT / "README.md", *listed, *rest]


_SNIPPET = re.compile(r'^--8<--\s+"([^"]+)"\s*$', re.MULTILINE)


def snippet_file(block: Block) -> Path:
    """The file a block shows with the snippets line `--8<-- "examples/NAME"`."""
    found = _SNIPPET.search(block.text)
    assert found, f"{block.where}: marked `file` but shows no --8<-- line"
    return ROOT / found.group(1)


def shown_by_file(path: Path) -> str:
    """What an example file says it prints: its .out file beside it, or else the comment lines
    (`# `, `// `) that end it."""
    out = path.with_suffix(".out")
    if out.exists():
        return out.read_text(encoding="utf-8")
    prefix = "// " if path.suffix in (".js", ".mjs", ".ts") else "# "
    tail: list[str] = []
    for line in reversed(path.read_text(encoding="utf-8").splitlines()):
        if not line.startswith(prefix):
            break
        tail.insert(0, line.removeprefix(prefix))
    assert tail, f"{path.name} shows no output"
    return "\n".join(tail) + "\n"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, with the mark of the comment before each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    pending: tuple[str, list[str]] | None = None
    i = 0
    while i < len(lines):
        mark = _MARK.match(lines[i].strip())
        fence = _FENCE.match(lines[i])
        if mark:
            pending = (mark.group(1), (mark.group(2) or "").split())
        elif fence:
            indent, ticks, language = fence.groups()
            body = []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(ticks):
                body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
                i += 1
            block = Block(path, i - len(body), language, "\n".join(body) + "\n")
            if pending is not None:
                block.mark, block.options = pending
            if block.mark == "output" and found:
                found[-1].output = block
            found.append(block)
            pending = None
        elif lines[i].strip():
            pending = None
        i += 1
    return found


def console_commands(text: str) -> list[tuple[str, str]]:
    """(command, shown output) pairs of a console block."""
    pairs: list[tuple[str, list[str]]] = []
    continuing = False
    for line in text.splitlines():
        if continuing:
            pairs[-1] = (pairs[-1][0] + "\n" + line, pairs[-1][1])
            continuing = line.endswith("\\")
        elif line.startswith("$ "):
            pairs.append((line[2:], []))
            continuing = line.endswith("\\")
        elif pairs:
            pairs[-1][1].append(line)
    return [(command, "\n".join(out).strip("\n")) for command, out in pairs]


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def same_json(got: Any, shown: Any, where: str = "") -> list[str]:
    """The differences between two JSON values, volatile keys left out."""
    if isinstance(shown, dict) and isinstance(got, dict):
        if got.keys() != shown.keys():
            return [f"{where or '.'}: keys {sorted(got)} where {sorted(shown)} are shown"]
        return [
            problem
            for key in shown
            if key not in VOLATILE_KEYS
            for problem in same_json(got[key], shown[key], f"{where}.{key}")
        ]
    if isinstance(shown, list) and isinstance(got, list):
        if len(got) != len(shown):
            return [f"{where}: {len(got)} items where {len(shown)} are shown"]
        pairs = enumerate(zip(got, shown, strict=True))
        return [p for i, (g, s) in pairs for p in same_json(g, s, f"{where}[{i}]")]
    if isinstance(shown, float) or isinstance(got, float):
        if (
            isinstance(got, (int, float))
            and isinstance(shown, (int, float))
            and not isinstance(got, bool)
            and math.isclose(got, shown, rel_tol=1e-6, abs_tol=1e-6)
        ):
            return []
    elif got == shown and type(got) is type(shown):
        return []
    return [f"{where}: got {got!r}, shown {shown!r}"]


def differences(got: str, shown: str) -> list[str]:
    """Why `got` is not the output shown (empty when it is)."""
    got, shown = got.strip("\n"), shown.strip("\n")
    shown_json = _json(shown)
    if shown_json is not None and not (isinstance(shown_json, (int, float)) and "..." in shown):
        got_json = _json(got)
        if got_json is None:
            return [f"shown JSON, got text:\n{got}"]
        return same_json(got_json, shown_json)
    pattern = ".*?".join(re.escape(part) for part in shown.split("..."))
    if re.fullmatch(pattern, got, flags=re.DOTALL):
        return []
    return [f"got:\n{got}\nshown:\n{shown}"]


_SHOWN_PORT = re.compile(r"(?<=127\.0\.0\.1:)8000\b|(?<=--port )8000\b|(?<=PORT=)8000\b")


def on_live(text: str, url: str) -> str:
    """The block with the shown address and port (8000) replaced by the live server's."""
    port = url.rsplit(":", 1)[1]
    return _SHOWN_PORT.sub(port, text)


def as_shown(text: str, url: str) -> str:
    """An output with the live server's address and port shown as the page shows them."""
    port = url.rsplit(":", 1)[1]
    return re.sub(rf"(?<=127\.0\.0\.1:){port}\b|(?<=, ){port}(?=\))", "8000", text)
