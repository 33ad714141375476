"""Signed scores: a compact JWS (EdDSA, Ed25519) over the answer itself and the trace it is
about, so that anyone holding the service's public key (GET /.well-known/jwks.json) can tell an
answer this service gave from an edited or typed one (app/core/signatures.py says what is
signed; clients/python's kp_scoring.signatures checks it). The keys are `cryptography`'s, the
JWS `joserfc`'s.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed448, rsa, x25519
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from joserfc import jws
from joserfc.jwk import OKPKey

from app.core.config import config_error
from app.core.signatures import ALGORITHM, signed_answer

_PEM_BLOCK = re.compile(rb"-----BEGIN [A-Z ]+-----.+?-----END [A-Z ]+-----", re.DOTALL)


@dataclass(frozen=True, slots=True)
class Signer:
    """Signs with `key`; publishes it and `previous` (public keys of earlier signing keys,
    kept so that scores signed before a rotation still verify)."""

    key: OKPKey
    previous: tuple[OKPKey, ...]
    issuer: str = "kp-scoring"
    #: Set: the payload's `aud`, the party the scores are for (a registry).
    audience: str | None = None
    #: Set: the payload's `exp` is this many seconds after `iat`.
    lifetime_s: int | None = None

    def jwks(self) -> dict[str, list[dict[str, Any]]]:
        # A key's id is its RFC 7638 thumbprint: stable, and needs no naming scheme.
        kid = self.key.thumbprint()
        keys = [self.key, *(k for k in self.previous if k.thumbprint() != kid)]
        use = {"alg": ALGORITHM, "use": "sig"}
        return {"keys": [{**k.as_dict(private=False), "kid": k.thumbprint(), **use} for k in keys]}

    def sign(
        self,
        answer: Mapping[str, Any],
        trace_sha256: str,
        *,
        dry_run: bool,
        claims: Mapping[str, Any] | None = None,
    ) -> str:
        """The JWS for one answer (what a registry checks: docs/operating/signatures.md):
        `answer` as the API shows it (every field app/core/signatures.py does not leave out,
        so that a field the answer gains is signed with it), `trace_sha256` the digest of the
        trace as the agent sent it, `dry_run`, and `claims`, a route's own."""
        issued = int(time.time())
        payload: dict[str, Any] = {
            "iss": self.issuer,
            "iat": issued,
            "trace_sha256": trace_sha256,
            "dry_run": dry_run,
            "answer": signed_answer(answer),
            **(claims or {}),
        }
        if self.audience is not None:
            payload["aud"] = self.audience
        if self.lifetime_s is not None:
            payload["exp"] = issued + self.lifetime_s
        header = {"alg": ALGORITHM, "kid": self.key.thumbprint(), "typ": "JWT"}
        token: str = jws.serialize_compact(
            header, orjson.dumps(payload), self.key, algorithms=[ALGORITHM]
        )
        return token


_KINDS: tuple[tuple[type, str], ...] = (
    (rsa.RSAPrivateKey, "an RSA key"),
    (ec.EllipticCurvePrivateKey, "an EC (ECDSA) key"),
    (ed448.Ed448PrivateKey, "an Ed448 key"),
    (x25519.X25519PrivateKey, "an X25519 key (key exchange, not signatures)"),
    (dsa.DSAPrivateKey, "a DSA key"),
)


def _read(path: Path, variable: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise config_error(variable, f"cannot read {path}: {exc.strerror}") from None


def load_private_key(path: Path) -> OKPKey:
    """The Ed25519 private key of KP_SIGNING_KEY_FILE, or ConfigError saying why not (never
    the key)."""
    refused = "SIGNING_KEY_FILE"
    try:
        key = serialization.load_pem_private_key(_read(path, refused), password=None)
    except (ValueError, TypeError) as exc:
        msg = f"{path} is not an unencrypted PEM private key: {exc}"
        raise config_error(refused, msg) from None
    if not isinstance(key, Ed25519PrivateKey):
        kind = next((name for cls, name in _KINDS if isinstance(key, cls)), "another kind of key")
        msg = f"{path} holds {kind}: an Ed25519 private key is needed"
        raise config_error(refused, f"{msg} (openssl genpkey -algorithm ed25519)")
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return OKPKey.import_key(pem)


def load_public_keys(path: Path) -> tuple[OKPKey, ...]:
    """The Ed25519 public keys of KP_SIGNING_PREVIOUS_KEYS_FILE (one or more PEM blocks), or
    ConfigError."""
    refused = "SIGNING_PREVIOUS_KEYS_FILE"
    blocks = _PEM_BLOCK.findall(_read(path, refused))
    if not blocks:
        raise config_error(refused, f"{path} holds no PEM public key")
    keys = []
    for i, block in enumerate(blocks):
        try:
            key = serialization.load_pem_public_key(block)
        except (ValueError, TypeError) as exc:
            msg = f"{path}, key {i + 1}: not a PEM public key: {exc}"
            raise config_error(refused, msg) from None
        if not isinstance(key, Ed25519PublicKey):
            raise config_error(refused, f"{path}, key {i + 1}: not an Ed25519 public key")
        pem = key.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        keys.append(OKPKey.import_key(pem))
    return tuple(keys)
