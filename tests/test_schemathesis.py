"""Property-based API tests from the service's own OpenAPI document (schemathesis).

Every generated request, valid or not, must get an answer that is not a 5xx and that matches
the documented status codes, content types, headers and response schemas; invalid requests
must be rejected. Not checked: `positive_data_acceptance`, since the service has rules that
JSON Schema cannot state (a created_at that is a real calendar date, limits set by KP_*).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import run_state_machine_as_test
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.server import LiveServer

pytestmark = [pytest.mark.server, pytest.mark.slow]

# Per operation with parameters; 7 operations. CI runs well over 1,000 cases in all.
EXAMPLES = int(os.environ.get("KP_TEST_SCHEMATHESIS_EXAMPLES", "300"))
OPERATIONS = [
    ("POST", "/evaluate"),
    ("POST", "/evaluate/batch"),
    ("GET", "/cache"),
    ("DELETE", "/cache"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
]
TOKEN = "schemathesis-admin-token"
cases_run: dict[str, int] = {}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log = Path(tmp_path_factory.mktemp("schemathesis")) / "server.log"
    env = {"KP_EMBEDDER_PRELOAD": "true", "KP_MAX_BATCH": "8", "KP_ADMIN_TOKEN": TOKEN}
    live = LiveServer(env, log)
    yield live
    live.stop()
    assert "Traceback" not in live.log()


@pytest.fixture(scope="module")
def api_schema(server: LiveServer) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


@pytest.mark.parametrize(("method", "path"), OPERATIONS)
def test_no_5xx_and_responses_match_the_schema(
    api_schema: schemathesis.BaseSchema, server: LiveServer, method: str, path: str
) -> None:
    operation = api_schema[path][method]
    key = f"{method} {path}"
    cases_run[key] = 0

    @given(case=operation.as_strategy())
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
            excluded_checks=[positive_data_acceptance],
        )

    check()
    assert cases_run[key] >= 1
    print(f"{key}: {cases_run[key]} generated cases")


def test_enough_cases_ran() -> None:
    """The suite above generated as many cases as it claims (needs the tests above to run)."""
    assert len(cases_run) == len(OPERATIONS)
    if EXAMPLES >= 300:
        assert sum(cases_run.values()) >= 1000, cases_run


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
            case.validate_response(
                response,
                excluded_checks=[positive_data_acceptance],
                transport_kwargs=kwargs or None,
            )

    run_state_machine_as_test(
        Sequences,
        settings=settings(
            max_examples=max(10, EXAMPLES // 6),
            stateful_step_count=6,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        ),
    )
    assert steps[0] >= 20
    print(f"stateful: {steps[0]} calls")
