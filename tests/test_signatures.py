"""Signed scores (KP_SIGNING_KEY_FILE) against a live server: the JWS verifies against the JWKS
with an independent library (PyJWT), fails after any claim is changed, and its trace_sha256
does not depend on how the trace was serialised; the CLI and the client verify too."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
import rfc8785
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from typer.testing import CliRunner

from app.core.config import ConfigError, Settings
from app.core.errors import ServiceError
from app.core.signatures import trace_digests, trace_sha256
from app.main import create_app
from app.schemas.trace import ReasoningTrace
from kp_scoring import KpScoringClient, SignatureInvalidError, verify_signature
from kp_scoring.cli import cli
from kp_scoring.signatures import trace_sha256 as client_sha256
from tests.factories import make_trace, step
from tests.server import Server, running_server

pytestmark = pytest.mark.server

CLAIMS = {"iss", "iat", "trace_sha256", "dry_run", "answer"}


def pem(key: Any) -> bytes:
    data: bytes = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return data


def public_pem(key: Any) -> bytes:
    data: bytes = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return data


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("signing")
    (directory / "current.pem").write_bytes(pem(ed25519.Ed25519PrivateKey.generate()))
    old = [ed25519.Ed25519PrivateKey.generate() for _ in range(2)]
    (directory / "previous.pem").write_bytes(b"".join(public_pem(k) for k in old))
    return directory


@pytest.fixture(scope="module")
def signing(keys_dir: Path) -> Iterator[Server]:
    with running_server(
        signing_key_file=str(keys_dir / "current.pem"),
        signing_previous_keys_file=str(keys_dir / "previous.pem"),
        signing_issuer="kp-scoring.test",
    ) as server:
        yield server


def jwks_of(server: Server) -> dict[str, Any]:
    r = httpx.get(f"{server.url}/.well-known/jwks.json")
    assert r.status_code == 200
    data: dict[str, Any] = r.json()
    return data


def pyjwt_decode(token: str, jwks: dict[str, Any]) -> dict[str, Any]:
    """PyJWT alone: the key picked by the token's kid from the published set."""
    kid = jwt.get_unverified_header(token)["kid"]
    key = jwt.PyJWKSet.from_dict(jwks)[kid]
    claims: dict[str, Any] = jwt.decode(
        token, key.key, algorithms=["EdDSA"], options={"verify_aud": False}
    )
    return claims


def canonical_sha256(trace: Any) -> str:
    return hashlib.sha256(rfc8785.dumps(trace)).hexdigest()


def test_a_score_verifies_against_the_jwks_with_pyjwt(signing: Server) -> None:
    trace = make_trace()
    answer = httpx.post(f"{signing.url}/evaluate", json=trace).json()
    token = answer["signature"]
    header = jwt.get_unverified_header(token)
    assert header["alg"] == "EdDSA"
    jwks = jwks_of(signing)
    assert header["kid"] == jwks["keys"][0]["kid"]
    assert len(jwks["keys"]) == 3  # the signing key, then the two earlier ones
    claims = pyjwt_decode(token, jwks)
    assert set(claims) == CLAIMS
    assert claims["iss"] == "kp-scoring.test"
    # The answer as shown, every field but the time it took and the signature itself.
    unsigned = {"elapsed_ms", "signature"}
    assert claims["answer"] == {k: v for k, v in answer.items() if k not in unsigned}
    assert claims["trace_sha256"] == canonical_sha256(trace)


def _tampered(token: str, claim: str) -> str:
    header, payload, signature = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    value = claims[claim]
    if isinstance(value, bool):
        claims[claim] = not value
    elif isinstance(value, (int, float)):
        claims[claim] = value + 1
    elif isinstance(value, dict):
        claims[claim] = {**value, "score": 1.0 - value["score"] + 0.125}
    else:
        claims[claim] = value + "x"
    changed = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    return f"{header}.{changed}.{signature}"


@pytest.mark.parametrize("claim", sorted(CLAIMS))
def test_changing_any_claim_breaks_the_signature(signing: Server, claim: str) -> None:
    trace = make_trace()
    token = httpx.post(f"{signing.url}/evaluate", json=trace).json()["signature"]
    jwks = jwks_of(signing)
    forged = _tampered(token, claim)
    with pytest.raises(jwt.InvalidSignatureError):
        pyjwt_decode(forged, jwks)
    with pytest.raises(SignatureInvalidError):
        verify_signature(forged, trace, jwks)


def test_trace_sha256_ignores_key_order_and_whitespace(signing: Server) -> None:
    trace = make_trace(steps=[step(0, "thought", "plan ünïcödé"), step(1, "observation", "€ 1e3")])
    trace["metadata"]["quality_score"] = 0.1
    compact = json.dumps(trace, separators=(",", ":"))
    reordered = json.dumps(_reversed_keys(trace), indent=3, ensure_ascii=True)
    assert compact != reordered
    hashes = set()
    for body in (compact, reordered):
        r = httpx.post(
            f"{signing.url}/evaluate",
            content=body.encode(),
            headers={"content-type": "application/json"},
            params={"dry_run": "true"},
        )
        assert r.status_code == 200, r.text
        hashes.add(pyjwt_decode(r.json()["signature"], jwks_of(signing))["trace_sha256"])
    assert hashes == {canonical_sha256(trace)}


def _reversed_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _reversed_keys(v) for k, v in reversed(value.items())}
    if isinstance(value, list):
        return [_reversed_keys(v) for v in value]
    return value


def test_each_trace_of_a_batch_is_signed_for_itself(signing: Server) -> None:
    traces = [make_trace(trace_id="kp:trace:b1"), make_trace(trace_id="kp:trace:b2")]
    results = httpx.post(f"{signing.url}/evaluate/batch", json={"traces": traces}).json()
    jwks = jwks_of(signing)
    for trace, result in zip(traces, results["results"], strict=True):
        claims = verify_signature(result["signature"], trace, jwks, answer=result)
        assert claims["answer"]["trace_id"] == trace["id"]
    with pytest.raises(SignatureInvalidError, match="another trace"):
        verify_signature(results["results"][0]["signature"], traces[1], jwks)


def test_the_client_and_the_cli_verify(signing: Server, tmp_path: Path) -> None:
    trace = make_trace()
    with KpScoringClient(signing.url) as kp:
        answer = kp.evaluate(trace, dry_run=True)
        assert answer.signature is not None
        assert kp.verify(answer.signature, trace, answer=answer)["answer"]["score"] == answer.score
        with pytest.raises(SignatureInvalidError):
            kp.verify(answer.signature, {**trace, "id": "kp:trace:other"})
        model = ReasoningTrace.model_validate(trace)
        signed_model = kp.evaluate(model, dry_run=True).signature
        assert signed_model is not None
        assert kp.verify(signed_model, model)["answer"]["trace_id"] == trace["id"]
    trace_file = tmp_path / "trace.json"
    trace_file.write_text(json.dumps(trace, indent=2))
    answer_file = tmp_path / "answer.json"
    answer_file.write_text(answer.model_dump_json())
    jwks_file = tmp_path / "jwks.json"
    jwks_file.write_text(json.dumps(jwks_of(signing)))
    env = {"KP_URL": signing.url}
    runner = CliRunner()
    by_url = runner.invoke(cli, ["verify", str(trace_file), answer.signature], env=env)
    assert by_url.exit_code == 0, by_url.output
    assert by_url.stdout.startswith("valid: kp:trace:test-0001 scored 0.57625")
    by_file = runner.invoke(
        cli, ["verify", str(trace_file), str(answer_file), "--jwks", str(jwks_file), "--json"]
    )
    assert by_file.exit_code == 0, by_file.output
    assert json.loads(by_file.stdout)["answer"]["score"] == answer.score
    trace_file.write_text(json.dumps({**trace, "id": "kp:trace:forged"}))
    forged = runner.invoke(cli, ["verify", str(trace_file), answer.signature], env=env)
    assert forged.exit_code == 1
    assert "invalid: the signature is about another trace" in forged.stderr
    garbage = runner.invoke(cli, ["verify", str(trace_file), "a.b.c"], env=env)
    assert garbage.exit_code == 1
    assert "does not verify" in garbage.stderr


def test_unsigned_answers_say_null_and_publish_no_keys(server: Server) -> None:
    answer = httpx.post(f"{server.url}/evaluate", json=make_trace()).json()
    assert answer["signature"] is None
    assert jwks_of(server) == {"keys": []}


def test_a_trace_past_i_json_is_signed_as_javascript_reads_it(signing: Server) -> None:
    """An integer of 2**53 or more (RFC 8785 refuses it) is digested as the double
    JavaScript reads, one past every double as JSON.stringify writes Infinity (null): the
    service and the client hash it alike, and it verifies."""
    trace = make_trace()
    trace["task"]["input_schema"] = {"big": 2**60, "bigger": 10**400}
    r = httpx.post(f"{signing.url}/evaluate", json=trace)
    assert r.status_code == 200, r.text
    assert verify_signature(r.json()["signature"], trace, jwks_of(signing))
    read = {**trace, "task": {**trace["task"], "input_schema": {"big": 2.0**60, "bigger": None}}}
    assert trace_sha256(trace) == client_sha256(trace) == canonical_sha256(read)


def test_a_lone_surrogate_is_a_422_when_signing(signing: Server) -> None:
    trace = {**make_trace(), "notes": "PLACE"}  # a field the schema does not read
    body = json.dumps(trace).replace("PLACE", "\\udc00")
    r = httpx.post(
        f"{signing.url}/evaluate", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["body"]
    assert r.json()["detail"][0]["type"] == "not_canonicalizable"


# Bad key files: the start stops, naming the variable.


def _refused(**settings: Any) -> str:
    with pytest.raises(ConfigError) as refused:
        create_app(Settings(embedder="none", **settings))
    return str(refused.value)


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        (rsa.generate_private_key(public_exponent=65537, key_size=2048), "an RSA key"),
        (ec.generate_private_key(ec.SECP256R1()), "an EC (ECDSA) key"),
    ],
)
def test_a_signing_key_of_the_wrong_type_stops_the_start(
    tmp_path: Path, key: Any, expected: str
) -> None:
    path = tmp_path / "key.pem"
    path.write_bytes(pem(key))
    message = _refused(signing_key_file=path)
    assert message.startswith("kp-scoring: invalid configuration: KP_SIGNING_KEY_FILE: ")
    assert expected in message
    assert "Ed25519 private key is needed" in message


def test_a_public_key_or_garbage_as_the_signing_key_stops_the_start(
    tmp_path: Path, keys_dir: Path
) -> None:
    path = tmp_path / "key.pem"
    path.write_text("not a key")
    assert "KP_SIGNING_KEY_FILE: " in _refused(signing_key_file=path)
    assert "KP_SIGNING_KEY_FILE: " in _refused(signing_key_file=keys_dir / "previous.pem")
    rsa_public = tmp_path / "rsa.pub"
    rsa_public.write_bytes(public_pem(rsa.generate_private_key(65537, 2048)))
    message = _refused(
        signing_key_file=keys_dir / "current.pem", signing_previous_keys_file=rsa_public
    )
    assert "KP_SIGNING_PREVIOUS_KEYS_FILE: " in message
    assert "not an Ed25519 public key" in message


def _unsignable(traces: list[Any], **where: Any) -> list[tuple[tuple[Any, ...], str]]:
    try:
        trace_digests(traces, **where)
    except ServiceError as exc:
        refused = exc
    else:
        return []
    assert refused.status == 422
    assert refused.problems is not None
    return [(p.loc, p.type) for p in refused.problems]


def test_unsignable_traces_are_named_where_they_stand() -> None:
    fine, lone = make_trace(), make_trace()
    lone["task"]["objective"] = "\udc00"
    big = make_trace()
    big["task"]["input_schema"] = {"big": 2**60}
    assert _unsignable([fine, big], batch=False, at=("body",)) == []
    assert _unsignable([lone], batch=False, at=("body",)) == [(("body",), "not_canonicalizable")]
    batch = _unsignable([fine, lone, lone], batch=True, at=("body",))
    assert [loc for loc, _ in batch] == [("body", "traces", 1), ("body", "traces", 2)]
    assert [loc for loc, _ in _unsignable([lone], batch=True)] == [("traces", 0)]
