"""The OpenAPI document states every rule the service enforces, so that a request the document
calls valid is accepted (schemathesis checks it, tests/test_schemathesis.py) and clients
generated from it know the rules: the models give the shapes and patterns; this adds what the
settings decide (KP_MAX_STRING_CHARS on every string of a trace and every key of its free-form
objects, KP_MAX_STEPS, KP_MAX_BATCH), the nesting and body limits as prose, and that a bearer
key is needed only where the service is configured with keys.

The strings nested inside a free-form object (task.input_schema, steps[].input) have the same
bound, said in prose: a recursive schema for them turns into a type TypeScript refuses
(openapi-typescript writes it as an alias that refers to itself).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from app.core.config import Settings
from app.guards.idempotency import KEY_PATTERN, MAX_KEY_CHARS

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


def with_rules(document: Schema, settings: Settings) -> Schema:
    components: dict[str, Schema] = document["components"]["schemas"]
    state_trace_limits(components, "#/components/schemas/", settings)
    components["BatchIn"]["properties"]["traces"]["maxItems"] = settings.max_batch
    components["BatchIn"]["description"] = (
        f"At most {settings.max_batch} traces (KP_MAX_BATCH); the body's limits apply to the "
        "whole batch."
    )
    _optional_bearer(document)
    _idempotency_key_rule(document)
    return document


def state_trace_limits(definitions: dict[str, Schema], prefix: str, settings: Settings) -> None:
    """The trace's limits in its schemas (`definitions`, whose references start `prefix`):
    maxLength on every string, propertyNames on every free-form object, maxItems on steps."""
    n = settings.max_string_chars
    for name in _reachable(definitions, "ReasoningTrace", prefix):
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


def _reachable(definitions: dict[str, Schema], root: str, prefix: str) -> list[str]:
    """The names of the schemas `root` refers to, directly or not, `root` first."""
    found: list[str] = []
    stack = [root]
    while stack:
        name = stack.pop()
        if name in found:
            continue
        found.append(name)
        _each_ref(definitions[name], prefix, stack.append)
    return found


def _each_ref(value: Any, prefix: str, visit: Callable[[str], None]) -> None:
    if isinstance(value, dict):
        ref = value.get("$ref")
        if isinstance(ref, str) and ref.startswith(prefix):
            visit(ref.removeprefix(prefix))
        for item in value.values():
            _each_ref(item, prefix, visit)
    elif isinstance(value, list):
        for item in value:
            _each_ref(item, prefix, visit)


def _idempotency_key_rule(document: Schema) -> None:
    """The header's rule (the service checks it): a string,
    never null (a header is sent or not)."""
    for operations in document["paths"].values():
        for operation in operations.values():
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


def _optional_bearer(document: Schema) -> None:
    """A bearer key is asked for only by a service with KP_API_KEYS_FILE (scoring) or
    KP_ADMIN_TOKEN (/cache); without them the routes are open. `{}` in `security` says so:
    either the scheme or nothing (the 401 answers say when a key is missing)."""
    for operations in document["paths"].values():
        for operation in operations.values():
            security = operation.get("security")
            if security and {} not in security:
                security.append({})
