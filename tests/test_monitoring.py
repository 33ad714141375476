"""The shipped alert rules and Grafana dashboard: valid, tested with promtool, and over metrics
the service really exports (deploy/prometheus/, deploy/grafana/)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "kp-scoring.json"
#: Series Prometheus makes itself, not the service.
PROMETHEUS_OWN = {"up"}
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool is missing: `make promtool` installs Debian's prometheus package")
    return subprocess.run(
        [found, *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=120
    )


@pytest.mark.promtool
def test_the_alert_rules_are_valid() -> None:
    checked = promtool("check", "rules", "alerts.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout


@pytest.mark.promtool
def test_the_alert_rules_pass_their_unit_tests() -> None:
    tested = promtool("test", "rules", "alerts_test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr


@pytest.mark.promtool
def test_the_example_configuration_is_valid_and_loads_the_rules() -> None:
    checked = promtool("check", "config", "prometheus.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "1 rule files found" in checked.stdout


def test_every_alert_has_a_unit_test() -> None:
    rules = set(re.findall(r"^\s+- alert: (\w+)", (PROMETHEUS / "alerts.yml").read_text(), re.M))
    tested = set(re.findall(r"alertname: (\w+)", (PROMETHEUS / "alerts_test.yml").read_text()))
    missing = (
        rules
        - tested
        - {"KpScoringEmbedderNotReady", "KpScoringSlowEvaluations", "KpScoringRateLimitUnchecked"}
    )
    assert not missing, f"alerts with no promtool test: {missing}"


def _queried(text: str) -> set[str]:
    """Metric names in PromQL: the service's (`kp_`, `process_`) and Prometheus's `up`."""
    return set(re.findall(r"\b((?:kp|process)_[a-z0-9_]+|up(?=\{))", text))


def _exported(client: TestClient) -> set[str]:
    body = client.get("/metrics").text
    return set(re.findall(r"^# TYPE (\S+) ", body, flags=re.M))


def _known(metric: str, exported: set[str]) -> bool:
    if metric in exported or metric in PROMETHEUS_OWN:
        return True
    return any(metric.endswith(s) and metric.removesuffix(s) in exported for s in _SUFFIXES)


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return exprs


def test_the_rules_and_the_dashboard_query_only_exported_metrics(
    client_no_embedder: TestClient,
) -> None:
    exported = _exported(client_no_embedder)
    assert "kp_http_requests" in exported or "kp_http_requests_total" in exported
    rules = (PROMETHEUS / "alerts.yml").read_text()
    for source, text in (("alerts.yml", rules), *(("dashboard", e) for e in _dashboard_exprs())):
        queried = _queried(text)
        assert queried, f"no metric found in {source}: {text}"
        unknown = {m for m in queried if not _known(m, exported)}
        assert not unknown, f"{source} queries metrics the service does not export: {unknown}"


def test_the_dashboard_covers_the_alerted_metrics() -> None:
    rules = _queried((PROMETHEUS / "alerts.yml").read_text()) - PROMETHEUS_OWN
    shown = set().union(*(_queried(e) for e in _dashboard_exprs()))
    base = {m.removesuffix("_bucket") for m in shown}
    missing = {m for m in rules if m not in shown and m.removesuffix("_bucket") not in base}
    assert not missing, f"alerted but not on the dashboard: {missing}"
