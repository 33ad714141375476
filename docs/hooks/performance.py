"""mkdocs hook: the performance page's tables, rendered from the committed bench results.

`<!-- bench: NAME -->` on docs/performance.md (or another page of PAGES) becomes the tables of
`bench/results/NAME.json`, headed by where the file comes from (its `run`: command, commit,
date, CPU, as bench/machine.py records them) and, when app/ is no longer the code that run
measured, a warning that the file is stale. A result that is missing renders as a note, never
a failed build; a file whose layout this renderer does not know renders as a flat list of its
figures.

`<!-- plot: NAME -->` becomes a chart of the same file, an SVG written inline by this hook:
a few lines and bars need no plotting library (matplotlib would add a heavy dependency to the
docs build and fonts to embed for a handful of shapes), and inline SVG loads nothing from
anywhere, so the site stays offline. `<!-- budget: latest -->` becomes what that run says of
the 100 ms budget, so that the page claims no more than the file measured.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from html import escape
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
MARKER = re.compile(r"<!-- bench: ([\w.-]+) -->")
PLOT_MARKER = re.compile(r"<!-- plot: ([\w.-]+) -->")

BUDGET_MARKER = re.compile(r"<!-- budget: ([\w.-]+) -->")
#: One evaluation of a typical trace, end to end (docs/performance.md).
BUDGET_MS = 100.0


def _number(value: Any) -> str:
    """A figure as the tables show it: four significant digits below 100, so that a value is
    not rounded onto a target it missed (0.9985 against >= 0.999 reads 0.9985, not 0.999)."""
    if isinstance(value, bool):
        return "PASS" if value else "FAIL"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != 0 and abs(value) < 0.001:
            return f"{value:.2g}"
        return f"{value:,.4g}" if abs(value) < 100 else f"{value:,.1f}"
    return str(value)


def _checked(value: Any) -> str:
    """A figure beside its target and verdict: as many digits as it has, up to six."""
    return f"{value:.6g}" if isinstance(value, float) else _number(value)


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_number(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _machine(data: dict[str, Any]) -> str:
    machine = data.get("machine")
    if isinstance(machine, dict):
        flags = ", ".join(machine.get("cpu_flags", []))
        parts = [f"{machine.get('cpu', '?')}, {machine.get('nproc', '?')} cores"]
        if flags:
            parts.append(f"({flags})")
        for key, label in (("onnxruntime", "onnxruntime"), ("python", "Python")):
            if key in machine:
                parts.append(f"{label} {machine[key]}")
        if "date" in machine:
            parts.append(f"on {machine['date']}")
        if "loadavg_start" in machine:
            parts.append(f"load average at start {machine['loadavg_start']}")
        return " ".join(parts[:2]) + "; " + ", ".join(parts[2:])
    if "cpu" in data:
        return str(data["cpu"])
    return "not recorded in the file"


def _git(*args: str, env: dict[str, str] | None = None) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=ROOT, env=env, capture_output=True, text=True, check=False
        )
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def app_tree_now() -> str | None:
    """app/'s git tree id as it is on disk, committed or not, computed as bench/machine.py
    computes what a run measured; None without git."""
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(scratch) / "index")}
        if _git("add", "--all", "--", "app", env=env) is None:
            return None
        return _git("write-tree", "--prefix=app/", env=env)


def staleness(run: dict[str, Any], now: str | None) -> str | None:
    """Why a file's figures are not of the code as it is (None: they are). `now`: app/'s tree
    as it is (app_tree_now)."""
    if now is None:
        return "there is no git history here to check it against app/"
    if run.get("app_tree") == now:
        return None
    last = _git("log", "-1", "--format=%h, %cs", "--", "app") or "?"
    if _git("status", "--porcelain", "--", "app"):
        last += ", and has changes not committed"
    commit = str(run.get("commit") or "")[:7] or "an unrecorded commit"
    return f"app/ has changed since this run measured it at {commit} (app/ last changed in {last})"


def _head(name: str, data: dict[str, Any], now: str | None) -> str:
    """Where the file comes from, and a warning when its figures are no longer the code's."""
    run = data.get("run")
    file = f"**File:** `bench/results/{name}.json`"
    if not isinstance(run, dict):
        return (
            f"**Command, commit and date:** not recorded in the file · **CPU:** "
            f"{_machine(data)} · {file}"
        )
    commit = str(run.get("commit") or "")[:7] or "not recorded"
    if run.get("uncommitted_changes"):
        commit += " with changes not committed"
    cpu = str(run.get("cpu") or _machine(data))
    machine = data.get("machine")
    if isinstance(machine, dict) and machine.get("cpu_flags"):
        cpu += f" ({', '.join(machine['cpu_flags'])})"
    parts = [
        f"**Command:** `{run.get('command', 'not recorded')}`",
        f"**Commit:** `{commit}`",
        f"**Date:** {str(run.get('date', 'not recorded'))[:10]}",
        f"**CPU:** {cpu}",
        file,
    ]
    head = " · ".join(parts)
    if isinstance(machine, dict) and "loadavg_start" in machine:
        head += f" · load average at start {machine['loadavg_start']}"
    if run.get("recorded_afterwards"):
        head += f"\n\n*Recorded {run['recorded_afterwards']}.*"
    why = staleness(run, now)
    if why is not None:
        command = run.get("command", "its command")
        head += (
            f'\n\n!!! warning "Stale: measured on other code"\n    {why}. These figures '
            f"describe the code that run measured, not this one: `{command}` on a quiet "
            "machine replaces them (bench/README.md)."
        )
    return head


def _flat(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _flat(inner, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list):
        if all(not isinstance(item, (dict, list)) for item in value):
            yield prefix, ", ".join(map(str, value))
    else:
        yield prefix, value


def _generic(data: dict[str, Any]) -> str:
    rows = [
        [key, value]
        for key, value in _flat(data)
        if key != "machine" and not key.startswith("machine.")
    ]
    return _table(["figure", "value"], rows[:80])


def _latest(data: dict[str, Any]) -> str:
    rows = [[t["target"], t["value"], t["pass"]] for t in data["targets"]]
    out = [_table(["target", "measured", "verdict"], rows)]
    missed = sum(not t["pass"] for t in data["targets"])
    if missed:
        out.append(f"This run missed {missed} of its {len(rows)} targets (FAIL): {MISSED}")
    notes = data.get("notes") or []
    if notes:
        out.append("\n".join(f"- {note}" for note in notes))
    return "\n\n".join(out)


def _reference(data: dict[str, Any]) -> str:
    figures = data["figures"]
    names = {
        "typical_p50_ms": "typical p50, ms",
        "long_p50_ms": "long p50, ms",
        "long_p99_ms": "long p99, ms",
        "rate_rps": "rate, /s (floor, reference: one at a time)",
        "cold_ms": "cold start to first answer, ms",
    }

    def cell(key: str) -> str:
        figure = figures.get(key)
        if not isinstance(figure, dict):
            return "-"
        return f"{_number(figure['median'])} ({_number(figure['min'])}-{_number(figure['max'])})"

    rows = []
    for suffix, label in names.items():
        service = "service_16_rate_rps" if suffix == "rate_rps" else f"service_{suffix}"
        rows.append([label, cell(f"floor_{suffix}"), cell(f"reference_{suffix}"), cell(service)])
    ratio_rows = [
        [
            name.replace("_", " "),
            f"{_number(r['median'])}x ({_number(r['min'])}-{_number(r['max'])})",
        ]
        for name, r in data["ratios"].items()
    ]
    out = [
        f"Median (min-max) of {data.get('rounds', '?')} rounds; the service over HTTP (16 "
        "clients for its rate), the reference SDK's `evaluateValue` in node, and the floor (a "
        "bare onnxruntime session in a loop).",
        _table(["measure", "floor", "reference (node)", "service"], rows),
        _table(["ratio", "median (min-max)"], ratio_rows),
    ]
    if "service_typical_around_model_ms" in figures:
        out.append(
            "Where a typical request's time goes in the service (means): "
            f"{cell('service_typical_mean_ms')} ms in all, of which the model's runs "
            f"(tokenizing included) {cell('service_typical_model_ms')} ms and the rest (HTTP, "
            f"the app, the hand-offs between threads) {cell('service_typical_around_model_ms')} "
            "ms."
        )
    if "max_score_difference" in data:
        out.append(
            "Largest score difference, service against reference on the same sequence: "
            f"{_number(data['max_score_difference'])}."
        )
    return "\n\n".join(out)


def _memory(data: dict[str, Any]) -> str:
    """bench.memory: the shared memory in Redis's Query Engine, one namespace, its answers at
    each HNSW EF_RUNTIME measured."""
    answers, sizes = [], []
    for size in data["sizes"]:
        for group in size["by_ef_runtime"]:
            near, fresh = group["near_duplicates"], group["fresh"]
            rest = fresh.get("beyond_0_02", {})
            answers.append(
                [
                    size["entries"],
                    group["ef_runtime"],
                    f"{_number(near.get('twin_named'))} ({_number(near.get('twins'))})",
                    _pair(near, "query_p50_ms", "query_p99_ms"),
                    fresh.get("within_0_02"),
                    fresh.get("recall"),
                    f"{_number(rest['count'])}: median {_number(rest['p50'])}, "
                    f"worst {_number(fresh.get('worst_difference'))}"
                    if rest
                    else "0",
                    _pair(fresh, "query_p50_ms", "query_p99_ms"),
                ]
            )
        sizes.append(
            [
                size["entries"],
                size.get("redis_bytes_per_entry"),
                _pair(size, "fill_s", "hnsw_ready_after_fill_s"),
            ]
        )
    out = [
        f"{_number(data.get('real_vectors', '?'))} real MiniLM vectors "
        f"({data.get('source', '')}), the rest derived from them; HNSW from "
        f"{_number(data.get('hnsw_from'))} entries; {data.get('cpu', '')}.",
        _table(
            [
                "entries",
                "EF_RUNTIME",
                "near-duplicate names its twin (count)",
                "its p50 / p99 ms",
                "fresh within 0.02",
                "fresh exact",
                "fresh past 0.02: count, spread",
                "fresh p50 / p99 ms",
            ],
            answers,
        ),
        _table(["entries", "Redis B / entry", "import s / HNSW answering after, s"], sizes),
    ]
    service = data.get("service")
    if service:
        rows = [
            ["entries", service["entries"]],
            [
                "new replica to ready, s: at size / at an empty memory",
                _pair(service, "replica_to_ready_large_s", "replica_to_ready_empty_s"),
            ],
            [
                "new replica RSS, MB: at size / at an empty memory",
                _pair(service, "replica_rss_large_mb", "replica_rss_empty_mb"),
            ],
        ]
        for turns in service["dry_run_by_ef_runtime"]:
            ef = f" (EF_RUNTIME {turns['ef_runtime']})"
            rows += [
                [
                    f"dry-run typical p50 / p99 ms at size{ef} / against 1,000 entries",
                    f"{_pair(turns, 'large_p50_ms', 'large_p99_ms')} / "
                    f"{_pair(turns, 'small_p50_ms', 'small_p99_ms')}",
                ],
                [f"ratio of the p50s{ef}", turns.get("request_ratio")],
            ]
        out.append(_table(["service at size", "value"], rows))
    checks = [
        [
            c["size"],
            c["ef_runtime"] or "",
            c["figure"],
            _checked(c["value"]),
            c["target"],
            c["pass"],
        ]
        for c in data.get("checks", [])
    ]
    if checks:
        out.append(
            _table(["entries", "EF_RUNTIME", "figure", "value", "target", "verdict"], checks)
        )
    return "\n\n".join(out)


def _precision(data: dict[str, Any]) -> str:
    speed = data["results"]["speed"]
    rows = [
        [
            kind,
            _pair(s, "float32_p50_ms", "float32_p99_ms"),
            _pair(s, "int8_p50_ms", "int8_p99_ms"),
            f"{_number(s['int8_per_text_ratio'])}x",
            _pair(s, "float32_two_one_core_runs_per_s", "int8_two_one_core_runs_per_s"),
            f"{_number(s['int8_throughput_ratio'])}x",
        ]
        for kind, s in speed.items()
    ]
    deviation = [
        [
            corpus,
            d["traces"],
            d["max_score_change"],
            d["mean_score_change"],
            d["over_0.005"],
            d["max_max_cosine_change"],
            d["min_vector_cosine"],
        ]
        for corpus, d in data["results"]["deviation"].items()
    ]
    return "\n\n".join(
        [
            _table(
                [
                    "texts",
                    "float32 p50 / p99 ms",
                    "int8 p50 / p99 ms",
                    "int8 / float32",
                    "two one-core runs, texts/s: float32 / int8",
                    "ratio",
                ],
                rows,
            ),
            _table(
                [
                    "corpus",
                    "traces",
                    "max score change",
                    "mean",
                    "> 0.005",
                    "max max_cosine change",
                    "lowest vector cosine",
                ],
                deviation,
            ),
        ]
    )


def _pair(data: dict[str, Any], first: str, second: str, middle: str = " / ", end: str = "") -> str:
    return f"{_number(data.get(first))}{middle}{_number(data.get(second))}{end}"


#: bench.persistence's servers, as its tables head them.
_KEEPERS = {
    "none": "kept nowhere",
    "process": "`process`",
    "power": "`power`",
    "former_everysec": "former `everysec`",
    "former_always": "former `always`",
    "former_process": "former `process`",
    "former_power": "former `power`",
}
#: Start to ready at a million entries, the target (docs/operating/persistence.md).
START_TARGET_S = 10.0


def _persistence(data: dict[str, Any]) -> str:
    """bench.persistence: the in-process memory's database against keeping nothing (and the
    former snapshot and journal, when the run had them)."""
    step = data.get("memory_step", {})
    commits = data.get("commits", {})
    trace = {k.removeprefix("sqlite_"): v for k, v in commits.get("trace", {}).items()}
    imports = {k.removeprefix("sqlite_"): v for k, v in commits.get("import_s", {}).items()}
    keepers = [k for k in _KEEPERS if k in step or k in trace]

    def cell(figures: dict[str, Any], key: str, unit: str, extra: str | None = None) -> str:
        if key not in figures:
            return "-"
        text = f"{_number(figures[key])} {unit}"
        return f"{text} (+{_number(figures[extra])})" if extra and extra in figures else text

    rows = []
    if step:
        rows.append(
            ["the memory's step of a committed trace, p50 (in process, 1,000 entries)"]
            + [cell(step.get(k, {}), "p50_us", "us") for k in keepers]
        )
    if trace:
        rows.append(
            [f"a committed `POST /evaluate`, p50 (end to end, {commits['requests']} each)"]
            + [cell(trace.get(k, {}), "p50_ms", "ms", "commit_ms") for k in keepers]
        )
        rows.append(["the same, p99"] + [cell(trace.get(k, {}), "p99_ms", "ms") for k in keepers])
    if imports:
        rows.append(
            [f"a {_number(commits['import_lines'])}-line `POST /cache/import`"]
            + [f"{_number(imports[k])} s" if k in imports else "-" for k in keepers]
        )
    out = []
    if rows:
        out.append(_table(["figure", *(_KEEPERS[k] for k in keepers)], rows))
    starts = data.get("start_to_ready", {})
    if starts:
        start_rows = []
        for size, figures in starts.items():
            row = [f"{_number(int(size))} entries ({_number(figures['database_mb'])} MB)"]
            for key in ("sqlite_s", "former_s"):
                runs = figures.get(key) or []
                row.append(
                    ", ".join(f"{_number(r)} s" for r in runs)
                    + (
                        f" (median {_number(sorted(runs)[len(runs) // 2])} s)"
                        if len(runs) > 2
                        else ""
                    )
                    if runs
                    else "-"
                )
            start_rows.append(row)
        out.append(
            _table(
                ["start to ready (model preloaded, memory loaded)", "the database", "former"],
                start_rows,
            )
        )
        million = starts.get("1000000", {}).get("sqlite_s")
        if million:
            median = sorted(million)[len(million) // 2]
            verdict = "PASS" if median <= START_TARGET_S else "FAIL"
            out.append(
                f"A million entries ready within {START_TARGET_S:g} s (median of the starts): "
                f"{_number(median)} s, **{verdict}**."
            )
    return "\n\n".join(out)


def _detectors(data: dict[str, Any]) -> str:
    """bench.detectors: per detector, what it found of the planted kinds and its false alarms
    on clean traces; the clean traces' share with any; the cost's linearity."""
    rows = [
        [
            f"`{name}`",
            figures["type"],
            f"{figures['planted_found']} of {figures['planted_of']}"
            if figures["planted_of"]
            else "-",
            figures["false_alarms"],
        ]
        for name, figures in data["by_detector"].items()
    ]
    out = [_table(["detector", "type", "planted, found", "false alarms"], rows)]
    planted, clean = data["planted"], data["clean"]
    sources = ", ".join(f"{v['traces']} {k}" for k, v in clean["by_source"].items())
    out.append(
        f"Planted: {planted['kinds']} kinds at {len(planted['places'])} places "
        f"({', '.join(planted['places'])}): **{planted['found']} of {planted['of']}** named at "
        f"their pointer with their type and detector; with `redact_suspected`, "
        f"{planted['kinds_redacted']} of {planted['kinds']} kinds gone from the contribution. "
        f"Clean traces ({sources}): **{clean['flagged']} of {clean['traces']}** with any "
        f"finding ({_number(100 * clean['flagged_share'])}%; target at most "
        f"{_number(100 * clean['target'])}%: **{_number(clean['pass'])}**)."
    )
    doc = data["documented_scan"]
    out.append(
        "detect-secrets as its README shows it (`scan_line`, default settings): "
        f"{doc['clean_flagged']} of {doc['clean_traces']} reference traces flagged, "
        f"{_number(doc['cpu_ms_per_trace'])} ms of CPU a trace."
    )
    cost = data["cost"]
    linear = [
        [
            kind,
            f"{_number(f['chars'])} chars",
            f"{_number(f['cpu_ms'])} ms",
            f"{_number(f['scaled_cpu_ms'])} ms",
            f"{_number(f['ratio'])}x",
            f["pass"],
        ]
        for kind, f in cost["megabyte"].items()
    ]
    out.append(
        _table(
            [
                "megabyte trace",
                "text",
                "detectors' CPU",
                f"{cost['scale']}x the text",
                "ratio",
                f"under {_number(next(iter(cost['megabyte'].values()))['target'])}x",
            ],
            linear,
        )
    )
    typical = cost["typical_cpu_ms"]
    out.append(
        f"A typical trace: the gate's CPU {_number(typical['gate'])} ms, of which the "
        f"detectors' {_number(typical['detectors'])} ms."
    )
    return "\n\n".join(out)


def _contribution(data: dict[str, Any]) -> str:
    """bench.contribution: /contribution against /evaluate on typical traces, and on megabyte
    traces against a full-window /evaluate; the detectors' linearity."""
    typical = data["typical"]
    e, c = typical["evaluate"], typical["contribution"]
    out = [
        _table(
            ["typical traces", "p50 ms", "p90 ms", "p99 ms"],
            [
                [f"`POST /evaluate` ({typical['n']})", e["p50_ms"], e["p90_ms"], e["p99_ms"]],
                [f"`POST /contribution` ({typical['n']})", c["p50_ms"], c["p90_ms"], c["p99_ms"]],
            ],
        ),
        f"/contribution's p50 over /evaluate's: **{_checked(typical['ratio_p50'])}x** "
        f"(target at most {_number(typical['target'])}x: **{_number(typical['pass'])}**); "
        f"the gate's own CPU {_number(typical['gate_cpu_ms'])} ms a trace.",
    ]
    rows = [
        [
            kind,
            f["body_bytes"],
            f["evaluate_p50_ms"],
            f["contribution_p50_ms"],
            f["full_window_evaluate_p50_ms"],
            f["gate_cpu_ms"],
            f["gate_cpu_over_full_window"],
        ]
        for kind, f in data["megabyte"].items()
    ]
    out.append(
        _table(
            [
                "megabyte trace",
                "body bytes",
                "/evaluate p50 ms",
                "/contribution p50 ms",
                "full-window /evaluate p50 ms",
                "gate CPU ms",
                "gate / full window",
            ],
            rows,
        )
    )
    linear = data.get("detectors_linear", {})
    kinds = {k: v for k, v in linear.items() if isinstance(v, dict)}
    if kinds:
        out.append(
            "The detectors on eight times the text: "
            + ", ".join(
                f"{kind} {_number(f['ratio'])}x ({_number(f['cpu_ms'])} to "
                f"{_number(f['scaled_cpu_ms'])} ms)"
                for kind, f in kinds.items()
            )
            + f"; under 12x: **{_number(linear['pass'])}**."
        )
    return "\n\n".join(out)


def _versus(data: dict[str, Any]) -> str:
    """bench.versus: this checkout against another, A B A B: each round's ratio."""
    rounds = len(data["this"])
    rows = []
    for key, what in (
        ("lone_over_floor", "the lone client's typical p50 over the floor (lower is better)"),
        ("rate_16_rps", "16 clients' rate (higher is better)"),
    ):
        r = data["ratio"][key]
        rows.append([what, r["median"], f"{_number(r['min'])}-{_number(r['max'])}"])
    medians = [
        [
            name,
            statistics.median(x["lone_p50_ms"] for x in data[key]),
            statistics.median(x["rate_16_rps"] for x in data[key]),
        ]
        for name, key in (("this checkout", "this"), ("the former", "former_figures"))
    ]
    settings = ", ".join(f"{k}={v}" for k, v in data.get("this_env", {}).items()) or "none"
    return "\n\n".join(
        [
            f"{rounds} rounds, the two servers in turn (A B, then B A); this checkout's own "
            f"settings: {settings}.",
            _table(["this checkout over the former", "median", "min-max"], rows),
            _table(["medians", "lone p50 ms", "16 clients /s"], medians),
        ]
    )


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "versus": _versus,
    "detectors": _detectors,
    "contribution": _contribution,
    "latest": _latest,
    "reference": _reference,
    "memory": _memory,
    "precision": _precision,
    "persistence": _persistence,
}


MISSED = (
    "the figure is published as measured, not rerun until it passes. Read it with the "
    "machine's load above: on a shared host a busy neighbour moves the figures of one run."
)


# --- charts: inline SVG ---------------------------------------------------------------------

#: The chart's size in CSS pixels, and its text's: drawn at this width wherever the column is as
#: wide (Material's content column is at least 670 px on a desktop: a 61rem grid at 20 px, less
#: a 12.1rem sidebar and the margins), scaled down only in a narrower one.
_WIDTH, _HEIGHT, _FONT = 640, 340, 13
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 178, 58, 50
_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")


def _ticks(top: float) -> list[float]:
    """Round steps from 0 to at least `top`, five or so."""
    raw = top / 5 if top > 0 else 1
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    return [i * step for i in range(math.ceil(top / step) + 1)]


def _svg(title: str, subtitle: str, body: list[str], label: str) -> str:
    """A figure drawn at _WIDTH x _HEIGHT CSS pixels (its figure shrinks to fit it, as
    Material's figures do, so the chart is never drawn at the caption's width)."""
    return (
        f'<figure class="kp-plot" markdown="0"><svg xmlns="http://www.w3.org/2000/svg" '
        f'viewBox="0 0 {_WIDTH} {_HEIGHT}" width="{_WIDTH}" height="{_HEIGHT}" role="img" '
        f'aria-label="{escape(label)}" font-family="sans-serif" font-size="{_FONT}" '
        f'fill="currentColor"><text x="{_WIDTH / 2}" y="20" text-anchor="middle" '
        f'font-weight="bold" font-size="{_FONT + 2}">{escape(title)}</text>'
        f'<text x="{_WIDTH / 2}" y="40" text-anchor="middle">{escape(subtitle)}</text>'
        + "".join(body)
        + f"</svg><figcaption>{escape(label)}</figcaption></figure>"
    )


def _axes(
    ticks: list[float], y_label: str, x_label: str
) -> tuple[list[str], Callable[[float], float]]:
    plot_h = _HEIGHT - _TOP - _BOTTOM

    def y(value: float) -> float:
        return _TOP + plot_h * (1 - value / ticks[-1])

    out = [
        f'<line x1="{_LEFT}" y1="{_TOP}" x2="{_LEFT}" y2="{_HEIGHT - _BOTTOM}" '
        'stroke="currentColor"/>',
        f'<line x1="{_LEFT}" y1="{_HEIGHT - _BOTTOM}" x2="{_WIDTH - _RIGHT}" '
        f'y2="{_HEIGHT - _BOTTOM}" stroke="currentColor"/>',
        f'<text x="16" y="{_TOP + plot_h / 2}" text-anchor="middle" '
        f'transform="rotate(-90 16 {_TOP + plot_h / 2})">{escape(y_label)}</text>',
        f'<text x="{(_LEFT + _WIDTH - _RIGHT) / 2}" y="{_HEIGHT - 8}" text-anchor="middle">'
        f"{escape(x_label)}</text>",
    ]
    for tick in ticks:
        out.append(
            f'<line x1="{_LEFT}" y1="{y(tick):.1f}" x2="{_WIDTH - _RIGHT}" y2="{y(tick):.1f}" '
            'stroke="currentColor" stroke-opacity="0.15"/>'
            f'<text x="{_LEFT - 6}" y="{y(tick) + 4:.1f}" text-anchor="end">{tick:g}</text>'
        )
    return out, y


def _legend(names: list[str]) -> list[str]:
    return [
        f'<rect x="{_WIDTH - _RIGHT + 12}" y="{_TOP + 20 * i}" width="12" height="12" '
        f'fill="{_COLOURS[i % len(_COLOURS)]}"/><text x="{_WIDTH - _RIGHT + 30}" '
        f'y="{_TOP + 20 * i + 11}">{escape(name)}</text>'
        for i, name in enumerate(names)
    ]


def line_chart(
    title: str,
    subtitle: str,
    x_label: str,
    y_label: str,
    xs: list[float],
    series: dict[str, list[float]],
    *,
    log_x: bool = False,
    mark: tuple[float, str] | None = None,
) -> str:
    """Lines over `xs`, placed by value, or by its logarithm with `log_x` (the x label should
    say which); `mark`: a dashed horizontal line at a value, with its label."""
    top = max(max(values) for values in series.values())
    if mark is not None:
        top = max(top, mark[0])
    ticks = _ticks(top)
    body, y = _axes(ticks, y_label, x_label)
    span = _WIDTH - _RIGHT - _LEFT - 40
    scale = math.log if log_x else float
    low, high = scale(min(xs)), scale(max(xs))

    def x(i: int) -> float:
        if high == low:
            return _LEFT + 20 + span / 2
        return _LEFT + 20 + span * (scale(xs[i]) - low) / (high - low)

    for i, value in enumerate(xs):
        body.append(
            f'<text x="{x(i):.1f}" y="{_HEIGHT - _BOTTOM + 18}" text-anchor="middle">'
            f"{value:g}</text>"
        )
    if mark is not None:
        body.append(
            f'<line x1="{_LEFT}" y1="{y(mark[0]):.1f}" x2="{_WIDTH - _RIGHT}" '
            f'y2="{y(mark[0]):.1f}" stroke="currentColor" stroke-dasharray="6 4"/>'
            f'<text x="{_WIDTH - _RIGHT - 4}" y="{y(mark[0]) - 5:.1f}" text-anchor="end">'
            f"{escape(mark[1])}</text>"
        )
    for k, values in enumerate(series.values()):
        colour = _COLOURS[k % len(_COLOURS)]
        points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(values))
        body.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="2"/>')
        body += [
            f'<circle cx="{x(i):.1f}" cy="{y(v):.1f}" r="3" fill="{colour}"/>'
            for i, v in enumerate(values)
        ]
    summary = "; ".join(
        f"{name}: "
        + ", ".join(f"{_number(v)} at {x_value:g}" for x_value, v in zip(xs, values, strict=True))
        for name, values in series.items()
    )
    return _svg(title, subtitle, body + _legend(list(series)), f"{title}. {summary}.")


def bar_chart(title: str, subtitle: str, y_label: str, groups: dict[str, dict[str, float]]) -> str:
    """Bars side by side in each group (a measure), one colour a series (who measured)."""
    names = list(next(iter(groups.values())))
    top = max(v for bars in groups.values() for v in bars.values())
    ticks = _ticks(top)
    body, y = _axes(ticks, y_label, "")
    span = _WIDTH - _RIGHT - _LEFT
    slot = span / len(groups)
    bar = slot * 0.7 / len(names)
    for g, (group, bars) in enumerate(groups.items()):
        left = _LEFT + slot * g + slot * 0.15
        for k, name in enumerate(names):
            value = bars[name]
            body.append(
                f'<rect x="{left + bar * k:.1f}" y="{y(value):.1f}" width="{bar - 2:.1f}" '
                f'height="{y(0) - y(value):.1f}" fill="{_COLOURS[k % len(_COLOURS)]}"/>'
            )
        body.append(
            f'<text x="{_LEFT + slot * (g + 0.5):.1f}" y="{_HEIGHT - _BOTTOM + 18}" '
            f'text-anchor="middle">{escape(group)}</text>'
        )
    summary = "; ".join(
        f"{group}: " + ", ".join(f"{name} {_number(v)}" for name, v in bars.items())
        for group, bars in groups.items()
    )
    return _svg(title, subtitle, body + _legend(names), f"{title}. {summary}.")


def _subtitle(data: dict[str, Any], now: str | None = None) -> str:
    """The machine and the code a chart's figures come from, in the figure itself, and
    whether that code is still app/ (`now`: app/'s tree as it is, when known)."""
    run = data.get("run") if isinstance(data.get("run"), dict) else {}
    cpu = run.get("cpu") or _machine(data)
    commit = str(run.get("commit") or "")[:7] or "commit not recorded"
    date = str(run.get("date") or "")[:10] or "date not recorded"
    stale = now is not None and staleness(run, now) is not None
    return f"{cpu} · {commit} · {date}" + (" · stale: app/ changed since" if stale else "")


def _subtitle_of(path: Path) -> str:
    return _subtitle(json.loads(path.read_text(encoding="utf-8")), app_tree_now())


def _plot_latest(data: dict[str, Any], subtitle: str) -> str:
    runs = data["results"]["concurrency"]
    clients = sorted(runs, key=int)
    xs = [float(c) for c in clients]
    floor = data["results"]["floor"]["typical"]["throughput_rps"]
    x_label = "concurrent clients (log scale: each step is x4)"
    throughput = line_chart(
        "Typical traces: answers a second against concurrent clients",
        subtitle,
        x_label,
        "answers / s",
        xs,
        {
            "service": [runs[c]["throughput_rps"] for c in clients],
            "floor, one at a time": [floor for _ in clients],
        },
        log_x=True,
    )
    latency = line_chart(
        "Typical traces: latency against concurrent clients",
        subtitle,
        x_label,
        "ms (linear)",
        xs,
        {
            "p50": [runs[c]["p50_ms"] for c in clients],
            "p99": [runs[c]["p99_ms"] for c in clients],
        },
        log_x=True,
        mark=(BUDGET_MS, f"budget: {BUDGET_MS:g} ms, one evaluation"),
    )
    return f"{throughput}\n\n{latency}"


def _plot_reference(data: dict[str, Any], subtitle: str) -> str:
    figures = data["figures"]
    who = {"floor": "floor", "reference (node)": "reference", "service": "service"}
    groups = {
        label: {name: figures[f"{prefix}_{key}"]["median"] for name, prefix in who.items()}
        for label, key in (
            ("typical p50", "typical_p50_ms"),
            ("long p50", "long_p50_ms"),
            ("long p99", "long_p99_ms"),
        )
    }
    rounds = data.get("rounds", "?")
    return bar_chart(
        f"Latency, one client: median of {rounds} rounds", subtitle, "ms (linear)", groups
    )


PLOTTERS: dict[str, Callable[[dict[str, Any], str], str]] = {
    "latest": _plot_latest,
    "reference": _plot_reference,
}


def plot(name: str, results: Path = RESULTS, now: str | None = None) -> str:
    """The chart of `bench/results/NAME.json`, or nothing when the file is missing or of a
    layout the plotter does not know (its table still says what the file holds); `now`:
    app/'s tree as it is (default: computed)."""
    path = results / f"{name}.json"
    if not path.is_file() or name not in PLOTTERS:
        return ""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        subtitle = _subtitle(data, app_tree_now() if now is None else now)
        return PLOTTERS[name](data, subtitle)
    except (KeyError, TypeError, ValueError, StopIteration):
        return ""


def render(name: str, results: Path = RESULTS, now: str | None = None) -> str:
    """The tables of `results/NAME.json`, headed by where they come from; `now`: app/'s tree
    as it is (default: computed)."""
    path = results / f"{name}.json"
    if not path.is_file():
        return f"!!! note\n    No `bench/results/{name}.json` is committed at the moment."
    data = json.loads(path.read_text(encoding="utf-8"))
    head = _head(name, data, app_tree_now() if now is None else now)
    try:
        body = RENDERERS.get(name, _generic)(data)
    except (KeyError, TypeError, ValueError):  # a layout this renderer does not know
        body = _generic(data)
    return f"{head}\n\n{body}"


#: The pages whose markers are rendered.
PAGES = (
    "performance.md",
    "contribution.md",
    "operating/persistence.md",
    "operating/large-memory.md",
)


def budget(name: str, results: Path = RESULTS) -> str:
    """What a run of the whole bench says of the budget, from its own figures: one client
    against it, and the concurrent clients that queue past it."""
    path = results / f"{name}.json"
    if not path.is_file():
        return ""
    try:
        r = json.loads(path.read_text(encoding="utf-8"))["results"]
        one, long = r["single_client"]["typical"], r["single_client"]["long"]
        crowd = {int(n): c["p50_ms"] for n, c in r["concurrency"].items() if int(n) > 1}
    except (KeyError, TypeError, ValueError):
        return ""
    verdict = "within" if one["p50_ms"] <= BUDGET_MS and one["p99_ms"] <= BUDGET_MS else "past"
    over = sorted(n for n, p50 in crowd.items() if p50 > BUDGET_MS)
    levels = ", ".join(f"{n} ({_number(p50)} ms)" for n, p50 in sorted(crowd.items()))
    first = f"On the run below ({_subtitle_of(path)}), one client's typical traces took "
    first += f"{_number(one['p50_ms'])} ms at the median and {_number(one['p99_ms'])} ms at the "
    first += f"99th percentile: {verdict} the budget."
    window = f"A full 512-token window took {_number(long['p50_ms'])} ms at the median."
    crowds = (
        f"With concurrent clients the median grew with the queue for the model's cores: {levels}"
    )
    text = f"{first} {window} {crowds}"
    if over:
        text += (
            f"; from {over[0]} clients on, past the budget, which is one evaluation's, not a "
            "crowd's on that machine's cores (answers a second are the measure there)"
        )
    return text + "."


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri not in PAGES:
        return markdown
    now = app_tree_now()
    markdown = PLOT_MARKER.sub(lambda match: plot(match.group(1), now=now), markdown)
    markdown = BUDGET_MARKER.sub(lambda match: budget(match.group(1)), markdown)
    return MARKER.sub(lambda match: render(match.group(1), now=now), markdown)
