"""A signature that cannot be misread, against a live server signing with an audience and a
lifetime: a dry run's payload says so and cannot pass a committed-score check, an answer
edited after signing fails verification, the issuer and audience are checked, an expired
signature is refused; and examples/verify_score.py (the registry's checks, with PyJWT)
runs as docs/operating/signatures.md shows it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from typer.testing import CliRunner

from kp_scoring.cli import cli
from kp_scoring.signatures import SignatureInvalidError, verify
from tests.factories import make_trace
from tests.server import ROOT, Server, running_server

pytestmark = pytest.mark.server

ISSUER = "kp-scoring.example"
AUDIENCE = "registry.example"
EXAMPLE = ROOT / "examples" / "verify_score.py"


@pytest.fixture(scope="module")
def signing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    key = tmp_path_factory.mktemp("claims") / "key.pem"
    key.write_bytes(
        ed25519.Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    with running_server(
        signing_key_file=str(key),
        signing_issuer=ISSUER,
        signing_audience=AUDIENCE,
        signing_lifetime_s="3600",
    ) as server:
        yield server


def scored(server: Server, trace: dict[str, Any], *, dry_run: bool) -> dict[str, Any]:
    r = httpx.post(f"{server.url}/evaluate", params={"dry_run": str(dry_run).lower()}, json=trace)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def jwks(server: Server) -> dict[str, Any]:
    keys: dict[str, Any] = httpx.get(f"{server.url}/.well-known/jwks.json").json()
    return keys


def test_a_dry_run_says_so_and_fails_a_committed_score_check(signing: Server) -> None:
    trace = make_trace(trace_id="kp:trace:dry")
    answer = scored(signing, trace, dry_run=True)
    claims = verify(answer["signature"], trace, jwks(signing), audience=AUDIENCE, answer=answer)
    assert claims["dry_run"] is True
    with pytest.raises(SignatureInvalidError, match="dry run"):
        verify(answer["signature"], trace, jwks(signing), audience=AUDIENCE, committed=True)

    committed = scored(signing, trace, dry_run=False)
    claims = verify(
        committed["signature"],
        trace,
        jwks(signing),
        issuer=ISSUER,
        audience=AUDIENCE,
        committed=True,
        answer=committed,
    )
    assert claims["dry_run"] is False
    assert claims["aud"] == AUDIENCE
    assert claims["exp"] == claims["iat"] + 3600


def test_the_batch_signs_dry_run_too(signing: Server) -> None:
    traces = [make_trace(trace_id=f"kp:trace:b{i}") for i in range(2)]
    r = httpx.post(
        f"{signing.url}/evaluate/batch", params={"dry_run": "true"}, json={"traces": traces}
    )
    for trace, answer in zip(traces, r.json()["results"], strict=True):
        claims = verify(answer["signature"], trace, jwks(signing), audience=AUDIENCE)
        assert claims["dry_run"] is True


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda a: a | {"score": 0.99}, "score"),
        (lambda a: a | {"trace_id": "kp:trace:other"}, "trace_id"),
        (lambda a: a | {"dimensions": a["dimensions"] | {"novelty": 1.0}}, "dimensions"),
        (lambda a: a | {"weights": a["weights"] | {"profile": "coding"}}, "weights.profile"),
        (lambda a: a | {"novelty": a["novelty"] | {"measured": True}}, "novelty.measured"),
    ],
)
def test_an_edited_answer_fails_verification(signing: Server, edit: Any, field: str) -> None:
    trace = make_trace(trace_id="kp:trace:edited")
    answer = scored(signing, trace, dry_run=True)
    with pytest.raises(SignatureInvalidError, match=f"the answer's {field} is"):
        verify(answer["signature"], trace, jwks(signing), audience=AUDIENCE, answer=edit(answer))


def test_issuer_audience_and_expiry_are_checked(signing: Server) -> None:
    trace = make_trace(trace_id="kp:trace:aud")
    answer = scored(signing, trace, dry_run=False)
    keys, token = jwks(signing), answer["signature"]
    with pytest.raises(SignatureInvalidError, match="not 'someone-else'"):
        verify(token, trace, keys, audience=AUDIENCE, issuer="someone-else")
    with pytest.raises(SignatureInvalidError, match="not 'other-registry'"):
        verify(token, trace, keys, audience="other-registry")
    with pytest.raises(SignatureInvalidError, match="name yours"):
        verify(token, trace, keys)  # signed for an audience: the verifier must be it
    with pytest.raises(SignatureInvalidError, match="expired"):
        verify(token, trace, keys, audience=AUDIENCE, now=time.time() + 3600 + 60)


def run_example(
    tmp_path: Path, trace: Any, answer: Any, *args: str
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "trace.json").write_text(json.dumps(trace))
    (tmp_path / "answer.json").write_text(json.dumps(answer))
    command = [sys.executable, str(EXAMPLE), str(tmp_path / "trace.json")]
    command += [str(tmp_path / "answer.json"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def test_the_registry_example_accepts_a_committed_score_only(
    signing: Server, tmp_path: Path
) -> None:
    trace = make_trace(trace_id="kp:trace:registry")
    url = f"{signing.url}/.well-known/jwks.json"
    checks = ("--issuer", ISSUER, "--audience", AUDIENCE)

    committed = scored(signing, trace, dry_run=False)
    ok = run_example(tmp_path, trace, committed, url, *checks)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("trusted: kp:trace:registry scored ")

    for answer, other_trace, args, reason in (
        (scored(signing, trace, dry_run=True), trace, checks, "dry run"),
        (committed | {"score": 0.99}, trace, checks, "the answer's score is not the signed one"),
        (committed, {**trace, "id": "kp:trace:x"}, checks, "about another trace"),
        (committed, trace, ("--issuer", "kp-scoring", "--audience", AUDIENCE), "issuer"),
        (committed, trace, ("--issuer", ISSUER, "--audience", "someone"), "audience"),
        (committed, trace, ("--issuer", ISSUER), "not for us"),
    ):
        refused = run_example(tmp_path, other_trace, answer, url, *args)
        assert refused.returncode == 1, (reason, refused.stdout)
        assert refused.stderr.startswith("refused: ")
        assert reason in refused.stderr.lower(), refused.stderr


def test_the_cli_fails_an_edited_answer_and_a_dry_run_when_committed_is_asked(
    signing: Server, tmp_path: Path
) -> None:
    trace = make_trace(trace_id="kp:trace:cli")
    (tmp_path / "trace.json").write_text(json.dumps(trace))
    env = {"KP_URL": signing.url, "NO_COLOR": "1", "COLUMNS": "200"}
    runner = CliRunner()

    def run(answer: dict[str, Any], *options: str) -> Any:
        (tmp_path / "answer.json").write_text(json.dumps(answer))
        args = ["verify", str(tmp_path / "trace.json"), str(tmp_path / "answer.json")]
        return runner.invoke(cli, [*args, "--audience", AUDIENCE, *options], env=env)

    committed = scored(signing, trace, dry_run=False)
    ok = run(committed, "--issuer", ISSUER, "--committed")
    assert ok.exit_code == 0, ok.output
    assert ok.stdout.startswith("valid: kp:trace:cli scored ")

    edited = run(committed | {"score": 0.99})
    assert edited.exit_code == 1
    assert "invalid: the answer's score is 0.99, the signed one" in edited.stderr

    dry = scored(signing, trace, dry_run=True)
    assert "a dry run" in run(dry).stdout
    refused = run(dry, "--committed")
    assert refused.exit_code == 1
    assert "dry run" in refused.stderr
    assert run(committed, "--issuer", "kp-scoring").exit_code == 1
