"""What the contribution gate's leak detectors find, what they raise falsely and what they cost
(docs/contribution.md, docs/decisions/leak-detectors.md), in process:

    python -m bench detectors [--out bench/results/detectors.json]

- found: every kind of bench/leaks.py planted in a step's content, input, output_summary, the
  objective and the outcome, through the whole gate (app.contribution.capture.prepare): found
  when a finding (or, for the SDK's own patterns, an `uncleaned` entry) names its place, its
  type and the expected detector; and with redact_suspected, its secret gone from the
  contribution and nothing left suspected;
- false alarms: every finding in traces with nothing planted (the reference fixtures' traces
  and the bench's typical and long corpus); target: at most 1% of the traces with any;
- the SDK's own fixture traces (tests/fixtures/contribution/capture.jsonl): what is suspected
  once its cleaning is done (no labels: to read, not to score);
- detect-secrets as its documentation shows it (`scan_line` under `default_settings`), on the
  same traces, and the cost of its KeywordDetector: the figures behind the choice;
- cost: the gate's CPU time on typical traces with and without the detectors, and the
  detectors' CPU time on megabyte traces and on traces eight times larger (each string the
  join of eight traces' strings); target: under 12x the time for 8x the text.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from app.contribution.capture import prepare
from app.contribution.detectors import DETECTORS, detect
from bench import corpus
from bench.leaks import PLACES, clean_traces, leaks, planted
from bench.machine import machine, provenance

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "detectors.json"
CAPTURE = (
    Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "contribution" / "capture.jsonl"
)
FALSE_ALARM_TARGET = 0.01
LINEAR_TARGET = 12.0
SCALE = 8


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _planted() -> dict[str, Any]:
    rows: dict[str, Any] = {}
    found = total = redacted = 0
    for leak in leaks():
        places: dict[str, bool] = {}
        gone = True
        for place, pointer in PLACES.items():
            trace = planted(leak.text, place, level=leak.level)
            gate = prepare(trace)
            named = {(f.path, f.type, f.detector) for f in (*gate.findings, *gate.uncleaned)}
            places[place] = (pointer, leak.type, leak.detector) in named
            cleaned = prepare(trace, redact_suspected=True)
            text = "\x00".join(_strings(cleaned.contribution))
            gone = gone and leak.secret not in text and not cleaned.leaks_remain
        found += sum(places.values())
        total += len(places)
        redacted += gone
        rows[leak.kind] = {
            "type": leak.type,
            "detector": leak.detector,
            "found": sum(places.values()),
            "of": len(places),
            "missed_at": [p for p, ok in places.items() if not ok],
            "redacted": gone,
        }
    return {
        "kinds": len(rows),
        "places": list(PLACES),
        "found": found,
        "of": total,
        "kinds_redacted": redacted,
        "by_kind": rows,
    }


def _clean() -> tuple[dict[str, Any], Counter[str]]:
    by_source: dict[str, Any] = {}
    alarms: Counter[str] = Counter()
    flagged_all = traces_all = 0
    for source, traces in clean_traces().items():
        flagged = 0
        for trace in traces:
            findings = prepare(trace).findings
            flagged += bool(findings)
            for f in findings:
                alarms[f.detector] += f.count
        by_source[source] = {"traces": len(traces), "flagged": flagged}
        flagged_all += flagged
        traces_all += len(traces)
    share = flagged_all / traces_all
    return {
        "by_source": by_source,
        "traces": traces_all,
        "flagged": flagged_all,
        "flagged_share": share,
        "target": FALSE_ALARM_TARGET,
        "pass": share <= FALSE_ALARM_TARGET,
    }, alarms


def _sdk_fixtures() -> dict[str, Any]:
    with CAPTURE.open(encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines]
    suspected: Counter[str] = Counter()
    uncleaned_in_inputs = 0
    traces = 0
    for row in rows:
        gate = prepare(row["trace"])
        traces += bool(gate.findings)
        for f in gate.findings:
            suspected[f.detector] += f.count
        uncleaned_in_inputs += sum(
            f.count
            for f in gate.uncleaned
            if "/input/" in f.path and not f.path.startswith(tuple(gate.inputs_kept))
        )
    return {
        "traces": len(rows),
        "traces_with_findings": traces,
        "by_detector": dict(suspected.most_common()),
        "uncleaned_in_cleaned_inputs": uncleaned_in_inputs,
    }


def _documented_scan(traces: list[Any], leak_traces: list[Any]) -> dict[str, Any]:
    """detect-secrets' own ad hoc scan (its README's Python use): every plugin, default
    settings, each string a line."""
    from detect_secrets.core.scan import scan_line
    from detect_secrets.settings import default_settings

    with default_settings():
        started = time.process_time()
        flagged = sum(bool([s for text in _strings(t) for s in scan_line(text)]) for t in traces)
        per_trace = (time.process_time() - started) * 1000 / len(traces)
        found = sum(bool([s for text in _strings(t) for s in scan_line(text)]) for t in leak_traces)
    return {
        "clean_traces": len(traces),
        "clean_flagged": flagged,
        "clean_flagged_share": flagged / len(traces),
        "planted_traces": len(leak_traces),
        "planted_flagged": found,
        "cpu_ms_per_trace": per_trace,
    }


def _best(work: Callable[[], Any], rounds: int = 3) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.process_time()
        work()
        best = min(best, time.process_time() - started)
    return best * 1000


def _keyword_cost(text: str) -> float:
    """detect-secrets' KeywordDetector over `text`: CPU microseconds per kilobyte."""
    from detect_secrets.plugins.keyword import KeywordDetector

    plugin = KeywordDetector()
    ms = _best(lambda: list(plugin.analyze_string(text)))
    return ms * 1000 / (len(text.encode()) / 1000)


def _scaled(items: list[corpus.Item], times: int) -> list[str]:
    """The strings of `times` traces of a kind joined string by string: the same shape, each
    string `times` as long."""
    columns = [list(_strings(item.trace)) for item in items[:times]]
    return [" ".join(parts) for parts in zip(*columns, strict=False)]


def _typical_ms(items: list[corpus.Item]) -> dict[str, float]:
    """Median CPU ms of the whole gate and of the detectors' part of it, a typical trace."""
    gate, detectors = [], []
    for item in items:
        trace = item.trace
        gate.append(_best(functools.partial(prepare, trace, quality_score=0.5)))
        texts = list(_strings(prepare(trace).contribution))
        detectors.append(_best(functools.partial(detect, texts)))
    return {"gate": statistics.median(gate), "detectors": statistics.median(detectors)}


def _cost(megabytes: int, seed: int) -> dict[str, Any]:
    typical = corpus.build("typical", 200, seed)
    per_kind: dict[str, Any] = {}
    for kind in corpus.MEGABYTE_KINDS:
        items = corpus.megabyte(kind, max(megabytes, SCALE), seed)
        one = [list(_strings(item.trace)) for item in items[:megabytes]]
        base = statistics.median(_best(functools.partial(detect, texts)) for texts in one)
        large = _scaled(items, SCALE)
        scaled = _best(functools.partial(detect, large))
        chars = statistics.median(sum(len(t) for t in texts) for texts in one)
        per_kind[kind] = {
            "chars": chars,
            "cpu_ms": base,
            "scaled_chars": sum(len(t) for t in large),
            "scaled_cpu_ms": scaled,
            "ratio": scaled / base,
            "target": LINEAR_TARGET,
            "pass": scaled / base < LINEAR_TARGET,
        }
    sample = " ".join(next(iter(_strings(i.trace))) for i in typical)
    return {
        "typical_cpu_ms": _typical_ms(typical),
        "megabyte": per_kind,
        "scale": SCALE,
        "keyword_detector_us_per_kb": _keyword_cost(sample),
    }


def run(megabytes: int, seed: int) -> dict[str, Any]:
    started = time.time()
    found = _planted()
    clean, alarms = _clean()
    by_detector = {
        d.name: {
            "type": d.type,
            "category": d.category,
            "planted_found": sum(
                row["found"] for row in found["by_kind"].values() if row["detector"] == d.name
            ),
            "planted_of": sum(
                row["of"] for row in found["by_kind"].values() if row["detector"] == d.name
            ),
            "false_alarms": alarms.get(d.name, 0),
        }
        for d in DETECTORS
    }
    leak_traces = [planted(leak.text, "content", level=leak.level) for leak in leaks()]
    reference = clean_traces()["reference fixtures"]
    return {
        "run": provenance(),
        "machine": machine(),
        "planted": found,
        "clean": clean,
        "by_detector": by_detector,
        "sdk_fixtures": _sdk_fixtures(),
        "documented_scan": _documented_scan(reference, leak_traces),
        "cost": _cost(megabytes, seed),
        "duration_s": time.time() - started,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench detectors", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--megabyte", type=int, default=2, help="megabyte traces of each kind")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    result = run(args.megabyte, args.seed)
    args.out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
