"""The published document (openapi/openapi.json) against a live service, with schemathesis:
every check it has, generated requests valid (positive) and not (negative), and stateful
sequences along the document's links.

So every request the document calls valid must be accepted: the document states each rule
the service enforces (app/api/openapi_doc.py). Two refusals of a valid request are rules of
state or of a format OpenAPI 3.1 cannot state, and only they are let through: an
Idempotency-Key already used for another request (422, as the IETF draft says), a
/cache/import body that is not lines of exported entries (NDJSON: 3.1 has no schema for each
line), a trace id refused for a character its pattern cannot state (outside the Basic
Multilingual Plane, a lone surrogate, or unassigned), a /contribution trace holding a lone
surrogate anywhere, and /contribution's suspicious_threshold above its reject_threshold (a
rule across two parameters, which 3.1 cannot state; each parameter's description says it).
Anything else fails.
"""

from __future__ import annotations

import json
import os
import re
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import run_state_machine_as_test
from schemathesis.checks import CHECKS, load_all_checks
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.server import ROOT, LiveServer

pytestmark = [pytest.mark.server, pytest.mark.slow]

DOCUMENT = ROOT / "openapi" / "openapi.json"
# Cases per operation and mode; the run stays within a few tens of seconds on 2 cores.
EXAMPLES = int(os.environ.get("KP_TEST_SCHEMATHESIS_EXAMPLES", "25"))
PATHS: dict[str, dict[str, Any]] = json.loads(DOCUMENT.read_text(encoding="utf-8"))["paths"]
OPERATIONS = [(method.upper(), path) for path, methods in PATHS.items() for method in methods]
#: Negative cases exist only where a request has something to get wrong.
WITH_INPUT = [
    (method, path)
    for method, path in OPERATIONS
    if {"parameters", "requestBody"} & set(PATHS[path][method.lower()])
]
MODES = [
    *((schemathesis.GenerationMode.POSITIVE, m, p) for m, p in OPERATIONS),
    *((schemathesis.GenerationMode.NEGATIVE, m, p) for m, p in WITH_INPUT),
]
TOKEN = "schemathesis-admin-token"
cases_run: dict[str, int] = {}


@schemathesis.serializer("application/x-ndjson")
def ndjson(ctx: Any, value: Any) -> dict[str, Any]:
    return {"data": value if isinstance(value, bytes) else str(value).encode("utf-8")}


def _refused_for_state_or_format(response: Any, case: schemathesis.Case) -> bool:
    if response.status_code != 422:
        return False
    if case.operation.path == "/cache/import":
        return True
    try:
        errors = response.json()["detail"]
    except (ValueError, KeyError, TypeError):
        return False
    types = [e.get("type") for e in errors]
    if types in (["idempotency_key_reused"], ["lone_surrogate"], ["threshold_order"]):
        # A lone surrogate is JSON the schema cannot exclude and UTF-8 cannot carry.
        return True
    return bool(errors) and all(_beyond_the_id_pattern(e) for e in errors)


def _beyond_the_id_pattern(error: dict[str, Any]) -> bool:
    """A trace id refused for a character the published pattern cannot state: one outside the
    Basic Multilingual Plane, a lone surrogate, or a code point Unicode leaves unassigned
    (app/schemas/ids.py)."""
    if error.get("type") != "trace_id_rule":
        return False
    found = re.search(
        r"character \d+ is \\(?:U([0-9a-f]{8})|u([0-9a-f]{4})|x[0-9a-f]{2})$", error["msg"]
    )
    if found is None:
        return False
    if found.group(1):
        return True
    return found.group(2) is not None and unicodedata.category(chr(int(found.group(2), 16))) in (
        "Cn",
        "Cs",
    )


def accepted(ctx: Any, response: Any, case: schemathesis.Case) -> bool | None:
    """positive_data_acceptance, but for the two refusals the module docstring names."""
    if _refused_for_state_or_format(response, case):
        return None
    return positive_data_acceptance(ctx, response, case)


load_all_checks()
CHECKS_RUN = [accepted if c is positive_data_acceptance else c for c in CHECKS.get_all()]


def test_every_check_runs() -> None:
    names = {c.__name__ for c in CHECKS_RUN}
    assert len(names) >= 14
    assert {"negative_data_rejection", "unsupported_method", "accepted"} <= names
    assert "positive_data_acceptance" not in names  # as `accepted`


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """Default limits (the document's), the model loaded, and an admin token."""
    log = Path(tmp_path_factory.mktemp("schemathesis")) / "server.log"
    live = LiveServer({"KP_EMBEDDER_PRELOAD": "true", "KP_ADMIN_TOKEN": TOKEN}, log)
    yield live
    live.stop()
    assert "Traceback" not in live.log()


CONFIG = Path(__file__).with_name("schemathesis.toml")


@pytest.fixture(scope="module")
def api_schema() -> schemathesis.BaseSchema:
    config = schemathesis.config.SchemathesisConfig.from_path(CONFIG)
    return schemathesis.openapi.from_path(DOCUMENT, config=config)


def test_the_document_is_the_one_the_service_serves(server: LiveServer) -> None:
    served = server.client.get("/openapi.json").json()
    assert served == json.loads(DOCUMENT.read_text(encoding="utf-8"))


@pytest.mark.parametrize(("generation", "method", "path"), MODES)
def test_generated_requests(
    api_schema: schemathesis.BaseSchema,
    server: LiveServer,
    generation: schemathesis.GenerationMode,
    method: str,
    path: str,
) -> None:
    operation = api_schema[path][method]
    key = f"{method} {path} {generation.value}"
    cases_run[key] = 0

    @given(case=operation.as_strategy(generation_mode=generation))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    def check(case: schemathesis.Case) -> None:
        cases_run[key] += 1
        case.call_and_validate(
            base_url=server.url,
            headers={"Authorization": f"Bearer {TOKEN}"},
            checks=CHECKS_RUN,
        )

    check()
    assert cases_run[key] >= 1


def test_enough_cases_ran() -> None:
    """The tests above generated cases for every operation (needs them to run first)."""
    assert len(cases_run) == len(MODES)
    assert len(WITH_INPUT) >= 3  # the scoring routes and the import
    assert sum(cases_run.values()) >= len(OPERATIONS) * 10, cases_run


def test_stateful_sequences_follow_the_openapi_links(
    api_schema: schemathesis.BaseSchema, server: LiveServer
) -> None:
    """Evaluate, read and reset the cache in generated orders (the links in openapi.json)."""
    steps = [0]

    class Sequences(api_schema.as_state_machine()):  # type: ignore[misc]
        def get_call_kwargs(self, case: schemathesis.Case) -> dict[str, object]:
            return {"base_url": server.url, "headers": {"Authorization": f"Bearer {TOKEN}"}}

        def validate_response(
            self, response: object, case: schemathesis.Case, **kwargs: object
        ) -> None:
            steps[0] += 1
            case.validate_response(response, checks=CHECKS_RUN, transport_kwargs=kwargs or None)

    run_state_machine_as_test(
        Sequences,
        settings=settings(
            max_examples=max(5, EXAMPLES // 3),
            stateful_step_count=6,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        ),
    )
    # Sequences ran (a run that stops at its first step would check little).
    assert steps[0] >= 2 * max(5, EXAMPLES // 3)
