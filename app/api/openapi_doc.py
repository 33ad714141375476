"""The OpenAPI document states every rule the service enforces, so that a request the document
calls valid is accepted (tests/test_schemathesis.py) and generated clients know the rules: the
models give the shapes and patterns; this adds what the settings decide, the nesting and body
limits as prose, and that a bearer key is needed only where the service has keys.

The strings nested inside a free-form object (task.input_schema, steps[].input) have the same
bound, said in prose: a recursive schema for them turns into a type TypeScript refuses
(openapi-typescript writes it as an alias that refers to itself).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from app.core.config import Settings
from app.guards.idempotency import KEY_PATTERN, MAX_KEY_CHARS
from app.schemas.trace import ReasoningTrace

Schema = dict[str, Any]


def install(app: FastAPI, settings: Settings) -> None:
    """Have `app.openapi()` (and /openapi.json) return the document with the settings' rules,
    built once, on first use, as FastAPI builds its own."""
    generate = app.openapi

    def document() -> Schema:
        first = app.openapi_schema is None
        built = generate()  # FastAPI's, which keeps it in app.openapi_schema
        if first:
            with_rules(built, settings)
        return built

    app.openapi = document  # type: ignore[method-assign]  # FastAPI's documented extension point


def with_rules(document: Schema, settings: Settings) -> None:
    definitions: dict[str, Schema] = document["components"]["schemas"]
    # maxLength on every string of the trace's schemas, propertyNames on every free-form
    # object, maxItems on steps (the trace's schemas: pydantic's, named as FastAPI names them).
    n = settings.max_string_chars
    nested = ReasoningTrace.model_json_schema(by_alias=True).get("$defs", {})
    for name in ("ReasoningTrace", *nested):
        for field in definitions[name].get("properties", {}).values():
            _limit_strings(field, n)
    trace = definitions["ReasoningTrace"]
    trace["properties"]["steps"]["maxItems"] = settings.max_steps
    trace["description"] = (
        f"{trace.get('description', '').rstrip('.')}. Limits (KP_*): at most "
        f"{settings.max_steps} steps, {n} characters per string and per key, and arrays and "
        f"objects nested at most {settings.max_json_depth} deep in the whole request body "
        f"(KP_MAX_JSON_DEPTH), which is at most {settings.max_body_bytes} bytes "
        "(KP_MAX_BODY_BYTES). Unknown fields are ignored."
    )
    definitions["BatchIn"]["properties"]["traces"]["maxItems"] = settings.max_batch
    definitions["BatchIn"]["description"] = (
        f"At most {settings.max_batch} traces (KP_MAX_BATCH); the body's limits apply to the "
        "whole batch."
    )
    for operations in document["paths"].values():
        for operation in operations.values():
            _operation_rules(operation)


def _limit_strings(field: Schema, n: int) -> None:
    if field.get("type") == "string" and "enum" not in field and "const" not in field:
        field["maxLength"] = min(field.get("maxLength", n), n)
    elif field.get("type") == "array" and isinstance(field.get("items"), dict):
        _limit_strings(field["items"], n)
    elif field.get("type") == "object" and field.get("additionalProperties") is True:
        field["propertyNames"] = {"maxLength": n}
        field["description"] = (
            f"Any JSON object: its keys, and the keys and strings nested in it, at most {n} "
            "characters."
        )


def _operation_rules(operation: Schema) -> None:
    """The Idempotency-Key header's rule (the service checks it): a string, never null (a
    header is sent or not). A bearer key is asked for only by a service with KP_API_KEYS_FILE
    (scoring) or KP_ADMIN_TOKEN (/cache): `{}` in `security` says either the scheme or nothing
    (the 401 answers say when a key is missing)."""
    for parameter in operation.get("parameters", ()):
        if parameter["in"] == "header" and parameter["name"] == "Idempotency-Key":
            described = parameter["schema"]
            parameter["schema"] = {
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_KEY_CHARS,
                "pattern": KEY_PATTERN,
                "title": described.get("title", "Idempotency-Key"),
                "description": described.get("description", ""),
            }
    security = operation.get("security")
    if security and {} not in security:
        security.append({})
