"""A signature that cannot be misread, against a live server signing with an audience and a
lifetime: a dry run's payload says so and cannot pass a committed-score check, an answer
edited after signing fails verification, the issuer and audience are checked, an expired
signature is refused; and examples/verify_score.py (the registry's checks, with PyJWT)
runs as docs/operating/signatures.md shows it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from joserfc.jwk import OKPKey
from typer.testing import CliRunner

from app.core.signatures import trace_sha256
from app.service.signing import Signer
from kp_scoring.cli import cli
from kp_scoring.signatures import (
    SignatureInvalidError,
    answer_mismatches,
    claim_problems,
    verify,
)
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


NEAREST = {"trace_id": "kp:trace:someone-else", "cosine": 0.99, "age_ms": 10}


# Every field a registry would act on; and one added, one removed.
EDITS = [
    (lambda a: a | {"score": 0.99}, "the answer's score is 0.99"),
    (lambda a: a | {"trace_id": "kp:trace:other"}, "the answer's trace_id is"),
    (lambda a: a | {"dimensions": a["dimensions"] | {"novelty": 1.0}}, "dimensions.novelty is"),
    (lambda a: a | {"weights": a["weights"] | {"profile": "coding"}}, "weights.profile is"),
    (lambda a: a | {"weights": a["weights"] | {"novelty": 0.9}}, "weights.novelty is"),
    (lambda a: a | {"profile": a["profile"] | {"name": "coding"}}, "profile.name is"),
    (lambda a: a | {"overrides": []}, "the answer's overrides is"),
    (lambda a: a | {"novelty": a["novelty"] | {"measured": True}}, "novelty.measured is"),
    (lambda a: a | {"novelty": a["novelty"] | {"max_cosine": 0.1}}, "novelty.max_cosine is"),
    (lambda a: a | {"novelty": a["novelty"] | {"cache_size": 99}}, "novelty.cache_size is"),
    (lambda a: a | {"novelty": a["novelty"] | {"nearest": NEAREST}}, "novelty.nearest is {"),
    (lambda a: a | {"verified_by": "us"}, "the answer's verified_by is not signed"),
    (lambda a: {k: v for k, v in a.items() if k != "profile"}, "the answer lacks profile"),
]


@pytest.mark.parametrize(("edit", "reason"), EDITS)
def test_an_edited_answer_fails_verification(signing: Server, edit: Any, reason: str) -> None:
    trace = make_trace(trace_id="kp:trace:edited")
    answer = scored(signing, trace, dry_run=True)
    assert answer["overrides"]
    keys = jwks(signing)
    assert verify(answer["signature"], trace, keys, audience=AUDIENCE, answer=answer)
    timed = answer | {"elapsed_ms": answer["elapsed_ms"] + 1000}
    assert verify(answer["signature"], trace, keys, audience=AUDIENCE, answer=timed)
    with pytest.raises(SignatureInvalidError, match=re.escape(reason)):
        verify(answer["signature"], trace, keys, audience=AUDIENCE, answer=edit(answer))


def test_issuer_audience_and_expiry_are_checked(signing: Server) -> None:
    trace = make_trace(trace_id="kp:trace:aud")
    answer = scored(signing, trace, dry_run=False)
    keys, token = jwks(signing), answer["signature"]
    with pytest.raises(SignatureInvalidError, match='not "someone-else"'):
        verify(token, trace, keys, audience=AUDIENCE, issuer="someone-else")
    with pytest.raises(SignatureInvalidError, match='not "other-registry"'):
        verify(token, trace, keys, audience="other-registry")
    with pytest.raises(SignatureInvalidError, match="name yours"):
        verify(token, trace, keys)  # signed for an audience: the verifier must be it
    expiry = verify(token, trace, keys, audience=AUDIENCE)["exp"]
    # 5 s of leeway by default, for clocks that disagree; no more.
    assert verify(token, trace, keys, audience=AUDIENCE, now=expiry + 4.9)
    for late, leeway in ((5, None), (0, 0), (61, 60)):
        options = {} if leeway is None else {"leeway_s": leeway}
        with pytest.raises(SignatureInvalidError, match="expired"):
            verify(token, trace, keys, audience=AUDIENCE, now=expiry + late, **options)
    assert verify(token, trace, keys, audience=AUDIENCE, now=expiry + 59, leeway_s=60)


def test_a_claim_the_signature_lacks_is_said_so_never_as_none() -> None:
    """A service that signs for no audience (KP_SIGNING_AUDIENCE unset), a verifier that
    names one: the message says the signature names none, and how a service names one."""
    (problem,) = claim_problems({"iss": "kp-scoring"}, audience="my-registry")
    assert problem == (
        'the signature names no audience, not "my-registry" (the service names one when it '
        "has KP_SIGNING_AUDIENCE)"
    )
    (problem,) = claim_problems({}, issuer="kp-scoring")
    assert problem == 'the signature names no issuer, not "kp-scoring"'
    assert "None" not in " ".join(claim_problems({"aud": None}, audience="x", issuer="y"))


def test_a_difference_is_named_by_its_path_in_the_answer() -> None:
    signed = {"novelty": {"nearest": {"trace_id": "a", "cosine": 1}}, "overrides": ["x", "y"]}
    claims = {"answer": signed}
    shown = {"novelty": {"nearest": {"trace_id": "b", "cosine": 1.0}}, "overrides": ["x", "z"]}
    assert answer_mismatches(claims, signed | {"elapsed_ms": 3.0, "signature": "s"}) == []
    assert answer_mismatches(claims, shown) == [
        'the answer\'s novelty.nearest.trace_id is "b", the signed one "a"',
        'the answer\'s overrides.1 is "z", the signed one "y"',
    ]
    assert answer_mismatches(claims, signed | {"overrides": ["x"]}) == [
        'the answer\'s overrides is ["x"], the signed one ["x", "y"]'
    ]
    # JSON's words, never Python's: a null signed value, a boolean.
    assert answer_mismatches({"answer": {"a": None, "b": True}}, {"b": False}) == [
        "the answer lacks a, signed as null",
        "the answer's b is false, the signed one true",
    ]
    (older,) = answer_mismatches({"score": 0.5}, shown)
    assert "covers no answer" in older


def test_the_cli_honours_expiry_with_a_stated_leeway(tmp_path: Path) -> None:
    """A signature 10 s past its exp: refused with the default 5 s of leeway, accepted with
    --leeway 60 (the CLI's help says both)."""
    key = OKPKey.import_key(
        ed25519.Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    signer = Signer(key=key, previous=(), lifetime_s=-10)
    trace = make_trace(trace_id="kp:trace:late")
    answer = {"trace_id": trace["id"], "score": 0.5}
    (tmp_path / "trace.json").write_text(json.dumps(trace))
    (tmp_path / "jwks.json").write_text(json.dumps(signer.jwks()))
    token = signer.sign(answer, trace_sha256(trace), dry_run=False)
    args = ["verify", str(tmp_path / "trace.json"), token, "--jwks", str(tmp_path / "jwks.json")]
    runner = CliRunner()
    late = runner.invoke(cli, args)
    assert late.exit_code == 1, late.output
    assert "invalid: the signature expired" in late.stderr
    allowed = runner.invoke(cli, [*args, "--leeway", "60"])
    assert allowed.exit_code == 0, allowed.output
    assert allowed.stdout == "valid: kp:trace:late scored 0.5 by kp-scoring\n"
    help_text = runner.invoke(cli, ["verify", "--help"], env={"COLUMNS": "100"}).stdout
    assert "--leeway" in help_text
    assert "5 s unless given" in " ".join(help_text.split())


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
    env = {"KP_URL": signing.url}
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
