"""openapi/ holds what the code serves; this fails when they drift apart."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from app.api.openapi_export import OPENAPI_DIR, documents, render


@pytest.mark.parametrize("name", ["openapi.json", "reasoning-trace.schema.json"])
def test_committed_documents_match_the_code(name: str) -> None:
    committed = (OPENAPI_DIR / name).read_text(encoding="utf-8")
    assert committed == render(documents()[name]), (
        f"openapi/{name} is stale: run `python -m app.api.openapi_export`"
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
