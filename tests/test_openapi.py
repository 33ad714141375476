"""openapi/ holds what the code serves; this fails when they drift apart."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.openapi_export import OPENAPI_DIR, documents, render


@pytest.mark.parametrize("name", ["openapi.json", "reasoning-trace.schema.json"])
def test_committed_documents_match_the_code(name: str) -> None:
    committed = (OPENAPI_DIR / name).read_text(encoding="utf-8")
    assert committed == render(documents()[name]), (
        f"openapi/{name} is stale: run `python -m app.openapi_export`"
    )


def test_served_openapi_is_the_committed_one(client_no_embedder: TestClient) -> None:
    served = client_no_embedder.get("/openapi.json").json()
    assert served == json.loads((OPENAPI_DIR / "openapi.json").read_text(encoding="utf-8"))
    paths = set(served["paths"])
    assert {"/evaluate", "/evaluate/batch", "/cache", "/healthz", "/readyz", "/metrics"} <= paths


def test_trace_schema_states_the_rules() -> None:
    schema = json.loads((OPENAPI_DIR / "reasoning-trace.schema.json").read_text(encoding="utf-8"))
    assert {"@context", "@type", "id", "metadata", "task", "steps", "outcome"} <= set(
        schema["required"]
    )
    assert schema["properties"]["steps"]["minItems"] == 1


def _nullable_places(node: Any, where: str = "") -> list[str]:
    """Where a JSON Schema lets null in: a null type or a null default."""
    found: list[str] = []
    if isinstance(node, dict):
        if node.get("type") == "null" or "null" in (node.get("type") or []):
            found.append(where)
        if "default" in node and node["default"] is None:
            found.append(f"{where}.default")
        for key, value in node.items():
            found += _nullable_places(value, f"{where}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _nullable_places(value, f"{where}[{i}]")
    return found


def test_trace_schema_has_optional_fields_but_no_null() -> None:
    """As the reference's zod `.optional()`: a field may be left out, but null is invalid."""
    schema = json.loads((OPENAPI_DIR / "reasoning-trace.schema.json").read_text(encoding="utf-8"))
    assert _nullable_places(schema) == []
    step = schema["$defs"]["Step"]
    assert step["required"] == ["step_id", "type"]
    assert step["properties"]["content"]["type"] == "string"
    assert step["properties"]["latency_ms"] == {
        "minimum": 0,
        "title": "Latency Ms",
        "type": "number",
    }
    assert "source_skill" not in schema["required"]
    assert schema["properties"]["knowledge_graph_delta"] == {"$ref": "#/$defs/KnowledgeGraphDelta"}

    components = json.loads((OPENAPI_DIR / "openapi.json").read_text(encoding="utf-8"))
    trace_parts = ("ReasoningTrace", "Metadata", "Task", "Step", "Tool", "KnowledgeGraphDelta")
    for name in trace_parts:
        assert _nullable_places(components["components"]["schemas"][name], name) == []


def test_every_request_body_has_an_example_the_service_scores(
    client_no_embedder: TestClient,
) -> None:
    """Swagger UI's "Try it out" starts from the document's example: each must be a 200, and
    the one-trace example is examples/trace.json, the trace the docs show."""
    document = json.loads((OPENAPI_DIR / "openapi.json").read_text(encoding="utf-8"))
    trace = json.loads((OPENAPI_DIR.parent / "examples" / "trace.json").read_text("utf-8"))
    sent = 0
    for path in ("/evaluate", "/evaluate/batch"):
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["examples"], path
        for example in body["examples"].values():
            r = client_no_embedder.post(f"{path}?dry_run=true", json=example["value"])
            assert r.status_code == 200, (path, r.text)
            sent += 1
    (one,) = document["paths"]["/evaluate"]["post"]["requestBody"]["content"]["application/json"][
        "examples"
    ].values()
    assert one["value"] == trace
    assert sent >= 2
