"""API keys and scopes (KP_API_KEYS_FILE) against a live server: 401/403/200 by key and scope,
the admin token beside the file, open probes, keys never in the URL, bad files stop the start."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from app.core.config import ConfigError, Settings
from app.main import create_app
from kp_scoring import Forbidden, KpScoringClient, Unauthorized
from kp_scoring.cli import cli
from tests.factories import make_trace
from tests.keys import AGENT_A, OPS, bearer, entry, sha256, write_keys
from tests.server import TOKEN, LiveServer, Server, running_server

pytestmark = pytest.mark.server


def post(server: Server, headers: dict[str, str] | None = None, **kw: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/evaluate", json=make_trace(), headers=headers, **kw)


def test_scoring_needs_a_key_with_scope_evaluate(keyed: Server) -> None:
    missing = post(keyed)
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"].startswith("Bearer")
    assert missing.json()["detail"][0]["loc"] == ["header", "authorization"]
    unknown = post(keyed, bearer("kp-not-a-key"))
    assert unknown.status_code == 401
    assert unknown.headers["www-authenticate"].startswith("Bearer")
    wrong_scheme = post(keyed, {"Authorization": f"Basic {AGENT_A}"})
    assert wrong_scheme.status_code == 401
    no_scope = post(keyed, bearer(OPS))
    assert no_scope.status_code == 403
    assert "'evaluate'" in no_scope.json()["detail"][0]["msg"]
    assert "www-authenticate" not in no_scope.headers
    ok = post(keyed, bearer(AGENT_A))
    assert ok.status_code == 200, ok.text
    assert ok.json()["score"] == pytest.approx(0.57625)
    batch = httpx.post(
        f"{keyed.url}/evaluate/batch", json={"traces": [make_trace()]}, headers=bearer(OPS)
    )
    assert batch.status_code == 403


def test_the_cache_needs_scope_admin_or_the_admin_token(keyed: Server) -> None:
    assert httpx.get(f"{keyed.url}/cache").status_code == 401
    assert httpx.get(f"{keyed.url}/cache", headers=bearer(AGENT_A)).status_code == 403
    assert httpx.get(f"{keyed.url}/cache", headers=bearer(OPS)).status_code == 200
    assert httpx.get(f"{keyed.url}/cache", headers=bearer(TOKEN)).status_code == 200
    # The admin token is for /cache only: it has no scope evaluate.
    assert post(keyed, bearer(TOKEN)).status_code == 403


def test_probes_and_the_jwks_stay_open(keyed: Server) -> None:
    for path in ("/healthz", "/readyz", "/metrics", "/.well-known/jwks.json"):
        assert httpx.get(f"{keyed.url}{path}").status_code == 200, path


def test_a_key_in_the_query_string_is_refused_even_a_good_one(keyed: Server) -> None:
    for name in ("api_key", "token", "access_token"):
        r = post(keyed, bearer(AGENT_A), params={name: AGENT_A})
        assert r.status_code == 400
        assert r.json()["detail"][0]["loc"] == ["query", name]
        assert AGENT_A not in r.text


def test_refusals_are_counted_by_reason(keyed: Server) -> None:
    post(keyed)
    post(keyed, bearer(OPS))
    metrics = httpx.get(f"{keyed.url}/metrics").text
    assert 'kp_auth_refused_total{reason="missing"}' in metrics
    assert 'kp_auth_refused_total{reason="missing_scope"}' in metrics


def test_the_client_and_the_cli_send_the_key(keyed: Server, tmp_path: Path) -> None:
    with KpScoringClient(keyed.url, api_key=AGENT_A) as kp:
        assert kp.evaluate(make_trace(), dry_run=True).score == pytest.approx(0.57625)
    with KpScoringClient(keyed.url, api_key=OPS) as kp:
        with pytest.raises(Forbidden):
            kp.evaluate(make_trace())
        assert kp.cache_stats().size == 0  # an admin key serves /cache too
    with KpScoringClient(keyed.url) as kp, pytest.raises(Unauthorized):
        kp.evaluate(make_trace())
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(make_trace()))
    env = {"KP_URL": keyed.url, "NO_COLOR": "1", "KP_API_KEY": None}
    runner = CliRunner()
    by_flag = runner.invoke(cli, ["evaluate", str(trace), "--json", "--api-key", AGENT_A], env=env)
    assert by_flag.exit_code == 1, by_flag.output  # scored, below the threshold
    assert json.loads(by_flag.stdout)["score"] == pytest.approx(0.57625)
    by_env = runner.invoke(
        cli, ["evaluate", str(trace), "--json"], env={**env, "KP_API_KEY": AGENT_A}
    )
    assert by_env.exit_code == 1, by_env.output
    without = runner.invoke(cli, ["evaluate", str(trace)], env=env)
    assert without.exit_code == 2
    assert "wants an API key: pass --api-key or set KP_API_KEY" in without.stderr


def test_without_a_keys_file_scoring_stays_open(server: Server) -> None:
    assert post(server).status_code == 200
    # An agent that sends a bearer key anyway (its registry key, say) is served as before.
    assert post(server, bearer("kp-some-registry-key")).status_code == 200
    assert httpx.get(f"{server.url}/cache").status_code == 401  # KP_ADMIN_TOKEN still guards it
    assert httpx.get(f"{server.url}/readyz").json()["admin_auth"] is True


def test_a_keys_file_closes_the_cache_even_without_an_admin_token(tmp_path: Path) -> None:
    keys = write_keys(tmp_path / "keys.json", [entry("agent-a", AGENT_A, ["evaluate"])])
    with running_server(token=None, api_keys_file=str(keys)) as s:
        assert httpx.get(f"{s.url}/cache").status_code == 401
        assert httpx.get(f"{s.url}/cache", headers=bearer(AGENT_A)).status_code == 403
        ready = httpx.get(f"{s.url}/readyz").json()
        assert ready["admin_auth"] is True
        assert not any("open" in w for w in ready["warnings"])


# Bad files: the start stops, naming the variable and the entry.


def _start(path: Path) -> str:
    with pytest.raises(ConfigError) as refused:
        create_app(Settings(embedder="none", api_keys_file=path))
    return str(refused.value)


@pytest.mark.parametrize(
    ("entries", "expected"),
    [
        ([entry("a", "k1", ["evaluate", "scoring"])], "keys[0] ('a').scopes[1]: Input should be"),
        ([entry("a", "k1", [])], "keys[0] ('a').scopes: List should have at least 1 item"),
        ([{"name": "a", "sha256": "abc", "scopes": ["admin"]}], "keys[0] ('a').sha256"),
        ([{"name": "a", "key": "k1", "scopes": ["admin"]}], "keys[0] ('a').sha256: Field required"),
        ([entry("a", "k1", ["admin"]), entry("a", "k2", ["admin"])], "keys[1] ('a').name: another"),
        (
            [entry("a", "k1", ["admin"]), entry("b", "k1", ["admin"])],
            "keys[1] ('b').sha256: another",
        ),
        ([entry("a b", "k1", ["admin"])], "keys[0] ('a b').name: String should match"),
        ([entry("a", "k1", ["evaluate"], rate=0)], "keys[0] ('a').rate_per_minute"),
    ],
)
def test_a_bad_entry_stops_the_start(tmp_path: Path, entries: list[Any], expected: str) -> None:
    message = _start(write_keys(tmp_path / "keys.json", entries))
    assert message.startswith("kp-scoring: invalid configuration: KP_API_KEYS_FILE: ")
    assert expected in message


def test_a_file_that_is_not_json_or_missing_stops_the_start(tmp_path: Path) -> None:
    broken = tmp_path / "keys.json"
    broken.write_text('{"keys": [')
    assert "is not JSON" in _start(broken)
    with pytest.raises(ValueError, match="no such file"):
        Settings(api_keys_file=tmp_path / "absent.json")


def test_a_live_start_with_a_bad_file_exits_naming_it(tmp_path: Path) -> None:
    keys = write_keys(tmp_path / "keys.json", [entry("a", "k1", ["root"])])
    env = {"KP_EMBEDDER": "none", "KP_API_KEYS_FILE": str(keys)}
    with pytest.raises(RuntimeError, match=r"KP_API_KEYS_FILE: keys\[0\] \('a'\)\.scopes\[0\]"):
        LiveServer(env, tmp_path / "server.log")


def test_a_key_is_known_by_its_whole_hash_in_either_case(tmp_path: Path) -> None:
    from app.guards.api_keys import KeyRing, load_key_file

    upper = {"name": "a", "sha256": sha256(AGENT_A).upper(), "scopes": ["evaluate"]}
    ring = KeyRing(load_key_file(write_keys(tmp_path / "keys.json", [upper])))
    found = ring.identify(AGENT_A)
    assert found is not None
    assert found.name == "a"
    assert ring.identify(AGENT_A[:-1]) is None
    assert ring.identify(AGENT_A + "x") is None
    assert ring.identify(sha256(AGENT_A)) is None  # the hash itself is no key


def test_a_client_that_sends_its_whole_body_first_gets_the_401(keyed: Server) -> None:
    """urllib writes the whole body before it reads: the key is refused before the body is
    read, and the rest is dropped before the connection closes, so the client sees the 401."""
    body = b'{"pad": "' + b"x" * (2 * 1024 * 1024) + b'"}'
    request = urllib.request.Request(
        f"{keyed.url}/evaluate",
        data=body,
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    assert refused.value.code == 401
    assert refused.value.headers["connection"] == "close"
    assert json.loads(refused.value.read())["detail"][0]["loc"] == ["header", "authorization"]


@pytest.mark.parametrize(
    "query",
    [
        "api%5Fkey=",
        "apiKey=",
        "API_KEY=",
        "api-key=",
        "Api.Key=",
        "x-api-key=",
        "ACCESS%5FTOKEN=",
        "dry_run=true&authToken=",
        "dry_run=true;token=",
        "api+key=",
    ],
)
def test_any_spelling_of_a_key_in_the_query_string_is_refused(keyed: Server, query: str) -> None:
    r = httpx.post(
        f"{keyed.url}/evaluate?{query}{AGENT_A}", json=make_trace(), headers=bearer(AGENT_A)
    )
    assert r.status_code == 400, (query, r.text)
    (error,) = r.json()["detail"]
    assert error["loc"][0] == "query"
    assert error["type"] == "key_in_query"
    assert AGENT_A not in r.text


def test_two_authorization_headers_are_a_400(keyed: Server) -> None:
    for first, second in ((AGENT_A, AGENT_A), (AGENT_A, OPS), (OPS, AGENT_A)):
        headers = [("Authorization", f"Bearer {first}"), ("Authorization", f"Bearer {second}")]
        r = httpx.post(f"{keyed.url}/evaluate", json=make_trace(), headers=headers)
        assert r.status_code == 400, r.text
        assert r.json()["detail"][0] == {
            "loc": ["header", "authorization"],
            "msg": "one Authorization header, not 2",
            "type": "repeated_header",
        }
    assert post(keyed, bearer(AGENT_A)).status_code == 200
