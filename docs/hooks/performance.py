"""mkdocs hook: the performance page's tables, rendered from the committed bench results.

`<!-- bench: NAME -->` on docs/performance.md becomes the tables of
`bench/results/NAME.json`, headed by the machine (CPU, cores, flags, date, load) and the
command that made it. A result that is missing renders as a note, never a failed build; a
file whose layout this renderer does not know renders as a flat list of its figures.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
MARKER = re.compile(r"<!-- bench: ([\w.-]+) -->")

#: The command that writes each file, where the file does not say it itself.
COMMANDS = {
    "latest": "python -m bench --repeat 3",
    "reference": "python -m bench.reference --rounds 5",
    "memory": "python -m bench.memory --sizes 100000",
    "precision": "python -m bench.precision",
}


#: The CPU of a file that does not record it, as noted when it was run.
NOTED_CPUS: dict[str, str] = {}


def _number(value: Any) -> str:
    if isinstance(value, bool):
        return "PASS" if value else "FAIL"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != 0 and abs(value) < 0.001:
            return f"{value:.2g}"
        return f"{value:,.3f}".rstrip("0").rstrip(".") if abs(value) < 100 else f"{value:,.1f}"
    return str(value)


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


def _cpu(name: str, data: dict[str, Any]) -> str:
    if not isinstance(data.get("machine"), dict) and "cpu" not in data and name in NOTED_CPUS:
        return NOTED_CPUS[name]
    return _machine(data)


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
    """bench.memory: the shared memory in Redis's Query Engine, one namespace."""
    rows = []
    for size in data["sizes"]:
        near, fresh = size["near_duplicates"], size["fresh"]
        rest = fresh.get("beyond_0_02", {})
        rows.append(
            [
                size["entries"],
                f"{_number(near.get('twin_named'))} ({_number(near.get('twins'))})",
                _pair(near, "query_p50_ms", "query_p99_ms"),
                fresh.get("within_0_02"),
                fresh.get("recall"),
                f"{_number(rest.get('count', 0))}: median {_number(rest.get('p50'))}, "
                f"worst {_number(fresh.get('worst_difference'))}",
                _pair(fresh, "query_p50_ms", "query_p99_ms"),
                size.get("redis_bytes_per_entry"),
                _pair(size, "fill_s", "hnsw_ready_after_fill_s"),
            ]
        )
    header = [
        "entries",
        "near-duplicate names its twin (count)",
        "its p50 / p99 ms",
        "fresh within 0.02",
        "fresh exact",
        "fresh past 0.02: count, spread",
        "fresh p50 / p99 ms",
        "Redis B / entry",
        "import s / HNSW answering after, s",
    ]
    out = [
        f"{_number(data.get('real_vectors', '?'))} real MiniLM vectors "
        f"({data.get('source', '')}), the rest derived from them; HNSW from "
        f"{_number(data.get('hnsw_from'))} entries; {data.get('cpu', '')}.",
        _table(header, rows),
    ]
    service = data.get("service")
    if service:
        out.append(
            _table(
                ["service at size", "value"],
                [
                    ["entries", service["entries"]],
                    [
                        "dry-run typical p50 / p99 ms, at size",
                        _pair(service, "large_p50_ms", "large_p99_ms"),
                    ],
                    [
                        "the same against 1,000 entries",
                        _pair(service, "small_p50_ms", "small_p99_ms"),
                    ],
                    ["ratio of the p50s", service.get("request_ratio")],
                    [
                        "new replica to ready, s: at size / at an empty memory",
                        _pair(service, "replica_to_ready_large_s", "replica_to_ready_empty_s"),
                    ],
                    [
                        "new replica RSS, MB: at size / at an empty memory",
                        _pair(service, "replica_rss_large_mb", "replica_rss_empty_mb"),
                    ],
                ],
            )
        )
    checks = [
        [c["size"], c["figure"], c["value"], c["target"], c["pass"]] for c in data.get("checks", [])
    ]
    if checks:
        out.append(_table(["entries", "figure", "value", "target", "verdict"], checks))
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


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "latest": _latest,
    "reference": _reference,
    "memory": _memory,
    "precision": _precision,
}


def render(name: str, results: Path = RESULTS) -> str:
    path = results / f"{name}.json"
    if not path.is_file():
        return f"!!! note\n    No `bench/results/{name}.json` is committed at the moment."
    data = json.loads(path.read_text(encoding="utf-8"))
    command = data.get("command") or COMMANDS.get(name, "python -m bench")
    head = (
        f"**Command:** `{command}` · **CPU:** {_cpu(name, data)} · "
        f"**File:** `bench/results/{name}.json`"
    )
    try:
        body = RENDERERS.get(name, _generic)(data)
    except (KeyError, TypeError, ValueError):  # a layout this renderer does not know
        body = _generic(data)
    return f"{head}\n\n{body}"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri != "performance.md":
        return markdown
    return MARKER.sub(lambda match: render(match.group(1)), markdown)
