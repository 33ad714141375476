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


RESULTS = ROOT / "bench" / "results"


def _results() -> list[tuple[str, dict[str, Any]]]:
    return [(p.stem, json.loads(p.read_text())) for p in sorted(RESULTS.glob("*.json"))]


def test_every_result_file_records_where_it_comes_from() -> None:
    """Commit, command, date and CPU, and the app/ it measured; a command's round and repeat
    counts are the file's own."""
    assert _results()
    for name, data in _results():
        run = data["run"]
        assert re.fullmatch(r"[0-9a-f]{40}", run["commit"]), name
        assert run["command"].startswith("python -m bench"), name
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", run["date"]), name
        assert run["cpu"], name
        assert re.fullmatch(r"[0-9a-f]{40}", run["app_tree"]), name
        rounds = re.search(r"--rounds (\d+)", run["command"])
        if "rounds" in data:
            assert rounds is not None, name
            assert int(rounds.group(1)) == data["rounds"], name
        repeat = re.search(r"--repeat (\d+)", run["command"])
        if "settings" in data:
            assert int(repeat.group(1) if repeat else 1) == data["settings"]["repeat"], name


def test_the_performance_page_prints_where_each_result_comes_from(site: Path) -> None:
    """The command line, commit, date, CPU and round counts on the page are the files'; a file
    whose app/ is not app/ as it is now is marked stale, and only then."""
    performance = _hook("performance")
    now = performance.app_tree_now()
    pages = {
        page: " ".join(_text(site / page).split())
        for page in (
            "performance.html",
            "contribution.html",
            "operating/persistence.html",
            "operating/large-memory.html",
        )
    }
    for name, data in _results():
        run = data["run"]
        shown = [
            f"Command: {run['command']} · Commit: {run['commit'][:7]} · Date: {run['date'][:10]} "
            f"· CPU: {run['cpu']}",
            f"File: bench/results/{name}.json",
        ]
        found = [text for text in pages.values() if all(part in text for part in shown)]
        assert found, f"{name}: {shown[0]}"
        block = found[0].split(shown[1])[1][:400]
        stale = "Stale: measured on other code" in block
        assert stale is (run["app_tree"] != now), (name, block)
    reference = json.loads((RESULTS / "reference.json").read_text())
    assert f"Median (min-max) of {reference['rounds']} rounds" in pages["performance.html"]
    assert f"median of {reference['rounds']} rounds" in pages["performance.html"]


def test_a_result_is_stale_once_app_is_no_longer_what_it_measured(tmp_path: Path) -> None:
    performance = _hook("performance")
    now = performance.app_tree_now()
    assert now is not None
    assert re.fullmatch(r"[0-9a-f]{40}", now)
    run = {"commit": "0" * 40, "command": "python -m bench load", "date": "2026-01-02T03:04:05Z"}
    run |= {"cpu": "X, 2 cores"}
    for tree, stale in ((now, False), ("f" * 40, True)):
        (tmp_path / "latest.json").write_text(json.dumps({"run": run | {"app_tree": tree}}))
        rendered = performance.render("latest", tmp_path, now=now)
        assert "**Command:** `python -m bench load` · **Commit:** `0000000`" in rendered
        assert ("Stale: measured on other code" in rendered) is stale
        assert (
            "stale: app/ changed since"
            in performance._subtitle({"run": run | {"app_tree": tree}}, now)
        ) is stale


def test_the_bench_records_this_checkout_and_the_command_as_typed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from bench.machine import provenance

    monkeypatch.setattr(sys, "orig_argv", ["/x/.venv/bin/python", "-m", "bench", "load", "--quick"])
    run = provenance()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert run["commit"] == head.stdout.strip()
    assert run["command"] == "python -m bench load --quick"
    assert run["app_tree"] == _hook("performance").app_tree_now()


def test_the_charts_are_legible_at_the_column_s_width(site: Path) -> None:
    """Drawn at their own size where Material's content column is as wide (670 px at least on a
    desktop), text of 13 px, 12 at the least once scaled; the clients' axis says it is
    logarithmic; the CPU and the commit are in the figure."""
    page = (site / "performance.html").read_text(encoding="utf-8")
    charts = re.findall(r'<figure class="kp-plot".*?</figure>', page, flags=re.S)
    assert charts
    column = 670
    latest = json.loads((RESULTS / "latest.json").read_text())["run"]
    for chart in charts:
        svg = re.search(r"<svg [^>]*>", chart)
        assert svg is not None
        attributes = dict(re.findall(r'([\w-]+)="([^"]*)"', svg.group(0)))
        width, height = float(attributes["width"]), float(attributes["height"])
        assert attributes["viewBox"] == f"0 0 {width:g} {height:g}"
        sizes = [float(attributes["font-size"])]
        sizes += [float(v) for v in re.findall(r'<text[^>]*font-size="([\d.]+)"', chart)]
        assert min(sizes) * min(1.0, column / width) >= 12, sizes
        assert "AMD EPYC" in chart or latest["cpu"] in chart
    throughput, latency = charts[0], charts[1]
    for chart in (throughput, latency):
        assert "log scale" in chart
        assert f"{latest['commit'][:7]} · {latest['date'][:10]}" in chart
    assert "budget: 100 ms" in latency


def test_a_missing_or_unknown_result_renders_without_failing(tmp_path: Path) -> None:
    performance = _hook("performance")
    assert "No `bench/results/latest.json`" in performance.render("latest", tmp_path)
    (tmp_path / "latest.json").write_text(json.dumps({"machine": {"cpu": "X"}, "other": {"a": 1}}))
    rendered = performance.render("latest", tmp_path, now="0" * 40)
    assert "| other.a | 1 |" in rendered
    assert "X" in rendered
    assert "not recorded in the file" in rendered


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
    page = (site / "decisions" / "index.html").read_text(
        encoding="utf-8"
    )  # docs/decisions/index.md
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
    expected = [n for n in performance.PLOTTERS if (RESULTS / f"{n}.json").is_file()]
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
        for name in re.findall(r"`([\w-]+)` extra|\.\[([\w-]+)\]", page.read_text(encoding="utf-8"))
    }
    missing = [(page, a or b) for page, (a, b) in named if (a or b) not in extras]
    assert not missing, missing
