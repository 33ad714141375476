"""The documentation site builds with --strict, and its generated pages say what the code and
the committed results say: every KP_* setting with its description, every bench result with its
CPU and command, every decision record listed."""

from __future__ import annotations

import html
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from app.core.config import ENV_PREFIX, Settings

ROOT = Path(__file__).resolve().parents[1]
HOOKS = ROOT / "docs" / "hooks"


def _hook(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"docs_hook_{name}", HOOKS / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    mkdocs = Path(sys.executable).parent / "mkdocs"
    assert mkdocs.is_file() or shutil.which("mkdocs"), "the docs extra is not installed"
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [str(mkdocs) if mkdocs.is_file() else "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    return out


def _text(page: Path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text(encoding="utf-8")))


def test_every_setting_has_a_description() -> None:
    missing = [n for n, f in Settings.model_fields.items() if not (f.description or "").strip()]
    assert not missing, f"give these Settings fields a description=: {missing}"


def test_every_setting_is_on_the_configuration_page(site: Path) -> None:
    page = (site / "configuration.html").read_text(encoding="utf-8")
    text = _text(site / "configuration.html")
    for name, field in Settings.model_fields.items():
        variable = f"{ENV_PREFIX}{name.upper()}"
        assert f'id="{variable.lower()}"' in page, f"{variable} has no section"
        first_words = re.sub(r"`", "", field.description or "")[:40]
        assert first_words in " ".join(text.split()), f"{variable}'s description is missing"


def test_the_rendered_settings_follow_the_class() -> None:
    rendered = _hook("settings").render()
    sections = re.findall(r"^### (KP_\w+)$", rendered, flags=re.M)
    assert sections == [f"{ENV_PREFIX}{n.upper()}" for n in Settings.model_fields]
    assert "**Default:** `1000`" in rendered.split("### KP_CACHE_CAPACITY")[1].split("###")[0]


def test_the_performance_page_names_the_cpu_and_command_of_each_result(site: Path) -> None:
    text = " ".join(_text(site / "performance.html").split())
    performance = _hook("performance")
    for name in performance.RENDERERS:
        path = ROOT / "bench" / "results" / f"{name}.json"
        if not path.is_file():
            assert f"No bench/results/{name}.json" in text
            continue
        data = json.loads(path.read_text())
        command = data.get("command") or performance.COMMANDS[name]
        assert f"Command: {command}" in text, name
        cpu = (
            (data.get("machine") or {}).get("cpu")
            or data.get("cpu")
            or performance.NOTED_CPUS[name]
        )
        assert cpu.split(",")[0] in text, name
        assert f"File: bench/results/{name}.json" in text


def test_a_missing_or_unknown_result_renders_without_failing(tmp_path: Path) -> None:
    performance = _hook("performance")
    assert "No `bench/results/latest.json`" in performance.render("latest", tmp_path)
    (tmp_path / "latest.json").write_text(json.dumps({"machine": {"cpu": "X"}, "other": {"a": 1}}))
    rendered = performance.render("latest", tmp_path)
    assert "| other.a | 1 |" in rendered
    assert "X" in rendered


def test_the_persistence_figures_render_as_tables_with_the_start_target(tmp_path: Path) -> None:
    performance = _hook("performance")
    doc = {
        "machine": {"cpu": "X"},
        "command": "python -m bench persistence --former ../former",
        "memory_step": {k: {"p50_us": 100.0, "p99_us": 200.0} for k in ("none", "process")},
        "commits": {
            "requests": 100,
            "trace": {
                "none": {"p50_ms": 20.0, "p99_ms": 30.0, "commit_ms": 0.0},
                "sqlite_process": {"p50_ms": 21.5, "p99_ms": 31.0, "commit_ms": 1.5},
                "former_everysec": {"p50_ms": 21.0, "p99_ms": 31.0, "commit_ms": 1.0},
            },
            "import_lines": 30000,
            "import_s": {"none": 4.0, "sqlite_process": 4.5, "former_everysec": 4.2},
        },
        "start_to_ready": {
            "1000000": {"database_mb": 1600, "sqlite_s": [9.0, 11.0, 9.5], "former_s": [7.0]}
        },
    }
    (tmp_path / "persistence.json").write_text(json.dumps(doc))
    rendered = performance.render("persistence", tmp_path)
    assert "| figure | kept nowhere | `process` | former `everysec` |" in rendered
    assert "| 21.5 ms (+1.5) |" in rendered
    assert "9 s, 11 s, 9.5 s (median 9.5 s)" in rendered
    assert "median of the starts): 9.5 s, **PASS**" in rendered
    doc["start_to_ready"]["1000000"]["sqlite_s"] = [12.0, 10.5, 11.0]
    (tmp_path / "persistence.json").write_text(json.dumps(doc))
    assert "11 s, **FAIL**" in performance.render("persistence", tmp_path)


def test_the_memory_figures_render_a_row_for_each_ef_runtime(tmp_path: Path) -> None:
    performance = _hook("performance")
    group = {"twin_named": 1.0, "twins": 10, "query_p50_ms": 1.0, "query_p99_ms": 2.0}
    doc = {
        "cpu": "X",
        "real_vectors": 10,
        "hnsw_from": 10000,
        "sizes": [
            {
                "entries": 1000000,
                "redis_bytes_per_entry": 4500,
                "fill_s": 1.0,
                "hnsw_ready_after_fill_s": 2.0,
                "by_ef_runtime": [
                    {
                        "ef_runtime": ef,
                        "near_duplicates": group,
                        "fresh": group | {"within_0_02": within, "recall": 0.9},
                    }
                    for ef, within in ((100, 0.937), (400, 0.995))
                ],
            }
        ],
        "checks": [
            {
                "size": 1000000,
                "ef_runtime": 400,
                "figure": "fresh_within_0_02",
                "value": 0.995,
                "target": 0.99,
                "pass": True,
            },
        ],
    }
    (tmp_path / "memory.json").write_text(json.dumps(doc))
    rendered = performance.render("memory", tmp_path)
    assert "| 1,000,000 | 100 | 1 (10) | 1 / 2 | 0.937 | 0.9 | 0 | 1 / 2 |" in rendered
    assert "| 1,000,000 | 400 | 1 (10) | 1 / 2 | 0.995 | 0.9 | 0 | 1 / 2 |" in rendered
    assert "| 1,000,000 | 400 | fresh_within_0_02 | 0.995 | 0.99 | PASS |" in rendered


def test_the_decisions_page_lists_every_record(site: Path) -> None:
    page = (site / "decisions" / "index.html").read_text(encoding="utf-8")  # docs/decisions/index.md
    records = [p for p in (ROOT / "docs" / "decisions").glob("*.md") if p.name != "index.md"]
    assert records
    for record in records:
        assert f'href="{record.stem}.html"' in page, record.name
        body = record.read_text(encoding="utf-8")
        for section in ("## Context", "## Decision", "## Figures", "## Alternatives not kept"):
            assert section in body, f"{record.name} lacks {section}"


class _Assets(HTMLParser):
    """The URLs a page loads by itself (not the links a reader may follow)."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag in ("script", "img", "iframe", "source", "audio", "video", "embed"):
            self.urls.append(found.get("src") or "")
        elif tag == "link":  # stylesheets, fonts, preconnects, icons: all fetched
            self.urls.append(found.get("href") or "")
        elif tag == "object":
            self.urls.append(found.get("data") or "")


def test_the_site_loads_nothing_from_another_host(site: Path) -> None:
    """Offline as the service is: no font CDN, no script or stylesheet from elsewhere."""
    remote = re.compile(r"^(https?:)?//", re.IGNORECASE)
    loaded: list[str] = []
    for page in site.rglob("*.html"):
        parser = _Assets()
        parser.feed(page.read_text(encoding="utf-8"))
        loaded += [f"{page.relative_to(site)}: {u}" for u in parser.urls if remote.match(u)]
    for sheet in site.rglob("*.css"):
        text = sheet.read_text(encoding="utf-8")
        imports = re.findall(r"""(?:url\(\s*['"]?|@import\s+['"])((?:https?:)?//[^'")\s]+)""", text)
        loaded += [f"{sheet.relative_to(site)}: {u}" for u in imports]
    assert not loaded, loaded


class _Links(HTMLParser):
    """Every URL a page links to or loads."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.urls += [value for name, value in attrs if name in ("href", "src") and value]


def test_the_built_site_browses_as_files(site: Path) -> None:
    """Opened from the disk (file://, no server), every link leads to a file: no directory
    URL, which a browser shows as a listing. (404.html is a server's page: its links are
    absolute on purpose.)"""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    assert config["use_directory_urls"] is False
    broken = []
    for page in site.rglob("*.html"):
        if page.name == "404.html":
            continue
        parser = _Links()
        parser.feed(page.read_text(encoding="utf-8"))
        for url in parser.urls:
            path = url.split("#", 1)[0].split("?", 1)[0]
            if not path or re.match(r"^([a-z]+:|//)", path, flags=re.IGNORECASE):
                continue  # an anchor on the page, another host, mailto:, data:
            target = (page.parent / path).resolve()
            if not target.is_file():
                broken.append(f"{page.relative_to(site)}: {url}")
    assert not broken, broken[:20]


def _sections(nav: list[Any], parent: str | None = None) -> Iterator[tuple[str | None, Any]]:
    for entry in nav:
        if isinstance(entry, dict):
            for title, value in entry.items():
                yield parent, title
                if isinstance(value, list):
                    yield from _sections(value, title)
        else:
            yield parent, None


def test_no_section_of_the_nav_is_a_child_of_itself() -> None:
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["nav"]
    entries = list(_sections(nav))
    children: dict[str | None, list[str | None]] = {}
    for parent, title in entries:
        children.setdefault(parent, []).append(title)
    for parent, titles in children.items():
        if parent is None:
            continue
        # A page without a title in a section takes the section's name: "Decisions > Decisions".
        assert len(titles) > 1 or titles[0] not in (None, parent), (parent, titles)


def test_the_performance_page_plots_the_committed_results(site: Path) -> None:
    page = (site / "performance.html").read_text(encoding="utf-8")
    charts = re.findall(r'<figure class="kp-plot".*?</figure>', page, flags=re.S)
    performance = _hook("performance")
    expected = [n for n in performance.PLOTTERS if (ROOT / "bench/results" / f"{n}.json").is_file()]
    assert expected
    assert len(charts) >= len(expected)
    latest = json.loads((ROOT / "bench" / "results" / "latest.json").read_text())
    one_client = performance._number(latest["results"]["concurrency"]["1"]["throughput_rps"])
    assert any(f"service: {one_client} at 1" in html.unescape(chart) for chart in charts)
    assert all("<svg" in chart and ("<polyline" in chart or "<rect" in chart) for chart in charts)


def test_a_chart_of_a_missing_or_unknown_result_is_left_out(tmp_path: Path) -> None:
    performance = _hook("performance")
    assert performance.plot("latest", tmp_path) == ""
    (tmp_path / "latest.json").write_text(json.dumps({"other": 1}))
    assert performance.plot("latest", tmp_path) == ""


def test_a_figure_is_never_rounded_onto_the_target_it_missed() -> None:
    performance = _hook("performance")
    assert performance._number(0.9985) == "0.9985"
    assert performance._checked(0.9985) == "0.9985"
    assert performance._checked(6.703195679401687) == "6.7032"
    assert performance._number(0.5) == "0.5"


def test_every_bench_command_the_docs_name_exists() -> None:
    pages = [ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").rglob("*.md")]
    missing = [
        f"{page.relative_to(ROOT)}: python -m {module}"
        for page in pages
        for module in re.findall(r"python -m (bench(?:\.\w+)*)", page.read_text(encoding="utf-8"))
        if importlib.util.find_spec(module) is None
    ]
    assert not missing, missing


def test_every_snippet_line_is_whole() -> None:
    """A formatter that takes a ```python block for Python turns `--8<--` into `--8 < --`, and
    the page then shows that line instead of the file: such blocks use the `{ .python }`
    form, which formatters leave alone."""
    mangled = [
        str(page.relative_to(ROOT))
        for page in (ROOT / "docs").rglob("*.md")
        if re.search(r"--8\s+<\s*--|--8<\s+--", page.read_text(encoding="utf-8"))
    ]
    assert not mangled, mangled


def test_make_docs_installs_the_docs_extra_alone() -> None:
    """The site needs the service (its settings page reads Settings) and mkdocs, not the
    test toolchain."""
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^docs: \$\(BIN\)/\.installed-docs$", makefile, flags=re.M)
    recipe = makefile.split("$(BIN)/.installed-docs: $(BIN)/.installed\n")[1].split("\n\n")[0]
    assert "'.[docs]'" in recipe
    assert "test" not in recipe


def test_every_extra_the_docs_name_exists() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "optional-dependencies"
    ]
    pages = [ROOT / "README.md", ROOT / "Makefile", *(ROOT / "docs").rglob("*.md")]
    named = {
        (page.relative_to(ROOT).as_posix(), name)
        for page in pages
        for name in re.findall(
            r"`([\w-]+)` extra|\.\[([\w-]+)\]", page.read_text(encoding="utf-8")
        )
    }
    missing = [(page, a or b) for page, (a, b) in named if (a or b) not in extras]
    assert not missing, missing
