"""Traces an operator follows a request by: FastAPI's own OpenTelemetry request span, with the
service's steps under it (kp.score, holding the trace's id, namespace, tokens and novelty, and
its children: validation, the model's queue wait and run, the memory, signing). Collected with
the SDK's in-memory exporter, and from a live server over real OTLP/HTTP configured by the
standard OTEL_* variables; with no exporter configured nothing is traced."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519
from fastapi.testclient import TestClient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from app.core.config import Settings
from app.main import create_app
from tests.factories import make_trace
from tests.server import LiveServer
from tests.test_signatures import pem

STEPS = {
    "kp.score",
    "kp.validation",
    "kp.embed",
    "kp.model.queue",
    "kp.model.run",
    "kp.memory",
    "kp.sign",
}


@pytest.fixture
def exported(tmp_path: Path) -> Iterator[tuple[TestClient, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    key = tmp_path / "signing.pem"
    key.write_bytes(pem(ed25519.Ed25519PrivateKey.generate()))
    settings = Settings(signing_key_file=key)
    app = create_app(settings, telemetry={"tracer_provider": provider, "auto_configure": False})
    with TestClient(app) as client:
        yield client, exporter


def _by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    return {span.name: span for span in spans}


def _ancestors(span: ReadableSpan, spans: dict[str, ReadableSpan]) -> list[str]:
    """The names of the span's parents, nearest first."""
    by_id = {s.context.span_id: s for s in spans.values()}
    names = []
    while span.parent is not None and span.parent.span_id in by_id:
        span = by_id[span.parent.span_id]
        names.append(span.name)
    return names


def test_a_request_span_holds_the_service_s_steps(
    exported: tuple[TestClient, InMemorySpanExporter],
) -> None:
    client, exporter = exported
    first = make_trace(trace_id="kp:trace:first", objective="Load the model")
    assert client.post("/evaluate", json=first).status_code == 200
    exporter.clear()  # the first request loads the model; the second is a warm one
    # A new text: the model runs (a text seen before is the memo's).
    trace = make_trace(trace_id="kp:trace:traced", objective="Follow this request")
    answer = client.post("/evaluate", json=trace, headers={"KP-Namespace": "net-a"}).json()
    spans = _by_name(exporter.get_finished_spans())
    request = spans["POST /evaluate"]
    assert spans.keys() >= STEPS
    for step in STEPS:
        assert _ancestors(spans[step], spans)[-1] == request.name, step
    embed = spans["kp.embed"]
    for part in ("kp.model.queue", "kp.model.run"):
        assert _ancestors(spans[part], spans)[0] == "kp.embed"
        assert embed.start_time <= spans[part].start_time <= spans[part].end_time
    assert spans["kp.model.queue"].end_time <= spans["kp.model.run"].start_time
    assert (request.attributes or {})["http.route"] == "/evaluate"
    attributes = spans["kp.score"].attributes or {}
    assert attributes["kp.trace_id"] == ("kp:trace:traced",)
    assert attributes["kp.namespace"] == "net-a"
    assert attributes["kp.tokens"] == (answer["novelty"]["tokens"],)
    assert attributes["kp.novelty.measured"] is False  # net-a's memory was empty
    assert attributes["kp.novelty.reason"] == "cache_empty"
    assert attributes["kp.novelty.stored"] is True


def test_a_repeated_text_has_no_model_run(
    exported: tuple[TestClient, InMemorySpanExporter],
) -> None:
    """The memo answered: the model's spans are absent rather than empty."""
    client, exporter = exported
    trace = make_trace(trace_id="kp:trace:again", objective="Said twice")
    client.post("/evaluate", json=trace, params={"dry_run": "true"})
    exporter.clear()
    client.post("/evaluate", json=trace)
    names = {span.name for span in exporter.get_finished_spans()}
    assert {"kp.embed", "kp.memory"} <= names
    assert not names & {"kp.model.queue", "kp.model.run"}


def test_without_an_exporter_nothing_is_traced() -> None:
    app = create_app(Settings(embedder="none"))
    with TestClient(app) as client:
        assert client.post("/evaluate", json=make_trace()).status_code == 200
        service = app.state.service
        assert service.tracer is None
        assert service.runtime.evaluator.tracer is None


class _Collector(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint: keeps the names of the spans it is sent."""

    names: list[str] = []  # noqa: RUF012 (the one collector of the test)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                self.names.extend(span.name for span in scope.spans)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.server
def test_a_live_server_exports_over_otlp_as_the_otel_variables_say(tmp_path: Path) -> None:
    collector = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}"
    env = {
        "KP_EMBEDDER": "onnx",
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_SERVICE_NAME": "kp-scoring",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
    }
    server = LiveServer(env, tmp_path / "server.log")
    try:
        assert server.post("/evaluate", make_trace()).status_code == 200
        deadline = time.monotonic() + 30
        while not {"POST /evaluate", "kp.memory"} <= set(_Collector.names):
            assert time.monotonic() < deadline, (_Collector.names, server.log())
            time.sleep(0.1)
        assert {"kp.validation", "kp.embed", "kp.model.run"} <= set(_Collector.names)
    finally:
        server.stop()
        collector.shutdown()
