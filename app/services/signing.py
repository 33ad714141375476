"""Signed scores: a compact JWS (EdDSA, Ed25519) over what a score says about which trace, so
that anyone holding the service's public key (GET /.well-known/jwks.json) can tell a score this
service gave from a typed one.

`trace_sha256` is the SHA-256 of the trace's RFC 8785 (JCS) canonical JSON: whoever holds the
trace recomputes it whatever its whitespace or key order. The crypto is `cryptography`'s and
`joserfc`'s, the canonical form the `rfc8785` package's.
"""

from __future__ import annotations

import hashlib
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import rfc8785
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed448, rsa, x25519
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from joserfc import jws
from joserfc.errors import JoseError
from joserfc.jwk import KeySet, OKPKey
from joserfc.util import to_bytes

from app.services.evaluator import Evaluation

ALGORITHM = "EdDSA"
DEFAULT_ISSUER = "kp-scoring"
# RFC 9864 prefers the fully specified "Ed25519"; the registry and the issue ask for "EdDSA",
# which every JOSE library verifies. joserfc warns on each use: it is the choice made here.
warnings.filterwarnings("ignore", message="EdDSA is deprecated", module=r"joserfc\b")

_PEM_BLOCK = re.compile(rb"-----BEGIN [A-Z ]+-----.+?-----END [A-Z ]+-----", re.DOTALL)


class SigningKeyError(ValueError):
    """A signing key file that cannot be used (the message says why, never the key)."""


class SignatureInvalidError(Exception):
    """A signature that does not verify, or that is not about the trace given."""


class TraceNotCanonicalError(ValueError):
    """A trace RFC 8785 cannot put in canonical form (an integer past 2**53, say)."""


def trace_sha256(trace: Any) -> str:
    """Hex SHA-256 of the trace's RFC 8785 canonical JSON (`trace`: as parsed from JSON)."""
    try:
        canonical = rfc8785.dumps(trace)
    except (rfc8785.CanonicalizationError, UnicodeError) as exc:
        raise TraceNotCanonicalError(str(exc)) from None
    return hashlib.sha256(canonical).hexdigest()


def _public_jwk(key: OKPKey) -> dict[str, Any]:
    return {**key.as_dict(private=False), "kid": key.thumbprint(), "alg": ALGORITHM, "use": "sig"}


@dataclass(frozen=True, slots=True)
class Signer:
    """Signs with `key`; publishes it and `previous` (public keys of earlier signing keys,
    kept so that scores signed before a rotation still verify)."""

    key: OKPKey
    previous: tuple[OKPKey, ...]
    issuer: str = DEFAULT_ISSUER

    @property
    def kid(self) -> str:
        """RFC 7638 thumbprint of the public key: stable, and needs no naming scheme."""
        kid: str = self.key.thumbprint()
        return kid

    def jwks(self) -> dict[str, list[dict[str, Any]]]:
        keys = [_public_jwk(self.key)]
        keys += [_public_jwk(k) for k in self.previous if k.thumbprint() != self.kid]
        return {"keys": keys}

    def sign(self, evaluation: Evaluation, trace: Any) -> str:
        """The JWS for one answer; `trace` as the agent sent it (parsed JSON)."""
        s = evaluation.score
        claims = {
            "iss": self.issuer,
            "iat": int(time.time()),
            "trace_id": evaluation.trace_id,
            "trace_sha256": trace_sha256(trace),
            "score": s.value,
            "dimensions": {
                "complexity": s.dimensions.complexity,
                "novelty": s.dimensions.novelty,
                "tool_diversity": s.dimensions.tool_diversity,
                "outcome_confidence": s.dimensions.outcome_confidence,
            },
            "weights_profile": s.weights.name,
            "novelty_measured": evaluation.novelty.measured,
        }
        header = {"alg": ALGORITHM, "kid": self.kid, "typ": "JWT"}
        token: str = jws.serialize_compact(
            header, orjson.dumps(claims), self.key, algorithms=[ALGORITHM]
        )
        return token


def verify(signature: str, trace: Any, jwks: dict[str, Any]) -> dict[str, Any]:
    """The claims of `signature` if it verifies against a key of `jwks` (by its kid) and is
    about `trace` (parsed JSON, any key order); else SignatureInvalidError saying why."""
    try:
        keys = KeySet.import_key_set(jwks)  # type: ignore[arg-type]  # joserfc checks it
        found = jws.deserialize_compact(to_bytes(signature), keys, algorithms=[ALGORITHM])
    except (JoseError, ValueError, KeyError, TypeError) as exc:
        raise SignatureInvalidError(f"the signature does not verify: {exc}") from None
    if found.headers().get("alg") != ALGORITHM:
        raise SignatureInvalidError(f"the signature's alg is not {ALGORITHM}")
    try:
        claims: dict[str, Any] = orjson.loads(found.payload)
    except orjson.JSONDecodeError:
        raise SignatureInvalidError("the signed claims are not JSON") from None
    expected = trace_sha256(trace)
    if claims.get("trace_sha256") != expected:
        raise SignatureInvalidError(
            f"the signature is about another trace (trace_sha256 {claims.get('trace_sha256')}, "
            f"this trace's is {expected})"
        )
    return claims


_KINDS: tuple[tuple[type, str], ...] = (
    (rsa.RSAPrivateKey, "an RSA key"),
    (ec.EllipticCurvePrivateKey, "an EC (ECDSA) key"),
    (ed448.Ed448PrivateKey, "an Ed448 key"),
    (x25519.X25519PrivateKey, "an X25519 key (key exchange, not signatures)"),
    (dsa.DSAPrivateKey, "a DSA key"),
)


def load_private_key(path: Path) -> OKPKey:
    """The Ed25519 private key of a PEM file, or SigningKeyError saying why not."""
    return OKPKey.import_key(_ed25519_private(path))


def load_public_keys(path: Path) -> tuple[OKPKey, ...]:
    """The Ed25519 public keys of a PEM file (one or more blocks), or SigningKeyError."""
    return tuple(_ed25519_publics(path))


def _ed25519_private(path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SigningKeyError(f"cannot read {path}: {exc.strerror}") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise SigningKeyError(f"{path} is not an unencrypted PEM private key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        kind = next((name for cls, name in _KINDS if isinstance(key, cls)), "another kind of key")
        raise SigningKeyError(
            f"{path} holds {kind}: an Ed25519 private key is needed "
            "(openssl genpkey -algorithm ed25519)"
        )
    pem: bytes = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return pem


def _ed25519_publics(path: Path) -> list[OKPKey]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SigningKeyError(f"cannot read {path}: {exc.strerror}") from None
    blocks = _PEM_BLOCK.findall(data)
    if not blocks:
        raise SigningKeyError(f"{path} holds no PEM public key")
    keys = []
    for i, block in enumerate(blocks):
        try:
            key = serialization.load_pem_public_key(block)
        except (ValueError, TypeError) as exc:
            raise SigningKeyError(f"{path}, key {i + 1}: not a PEM public key: {exc}") from None
        if not isinstance(key, Ed25519PublicKey):
            raise SigningKeyError(f"{path}, key {i + 1}: not an Ed25519 public key")
        pem = key.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        keys.append(OKPKey.import_key(pem))
    return keys
