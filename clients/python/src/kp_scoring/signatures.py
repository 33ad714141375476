"""Checking signed scores, for anyone holding a trace and the service's JWKS (the client, the
CLI, a registry): the JWS must verify against a key of the set (by its kid) and be about the
trace, whose `trace_sha256` is the SHA-256 of its RFC 8785 (JCS) canonical JSON, so that it is
the same whatever the trace's whitespace or key order. `joserfc` checks the JWS, the `rfc8785`
package makes the canonical form. The service signs with the same hash (tests hold the two to
the same value).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from typing import Any

import rfc8785

__all__ = ["ALGORITHM", "SignatureInvalidError", "TraceNotCanonicalError", "trace_sha256", "verify"]

ALGORITHM = "EdDSA"
# RFC 9864 prefers the fully specified "Ed25519"; the registry asks for "EdDSA", which every
# JOSE library verifies. joserfc warns on each use: it is the choice made here.
warnings.filterwarnings("ignore", message="EdDSA is deprecated", module=r"joserfc\b")


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


def verify(signature: str, trace: Any, jwks: dict[str, Any]) -> dict[str, Any]:
    """The claims of `signature` if it verifies against a key of `jwks` (by its kid) and is
    about `trace` (parsed JSON, any key order); else SignatureInvalidError saying why."""
    # joserfc (and cryptography under it) only where a signature is checked.
    from joserfc import jws
    from joserfc.errors import JoseError
    from joserfc.jwk import KeySet
    from joserfc.util import to_bytes

    try:
        keys = KeySet.import_key_set(jwks)  # type: ignore[arg-type]  # joserfc checks it
        found = jws.deserialize_compact(to_bytes(signature), keys, algorithms=[ALGORITHM])
    except (JoseError, ValueError, KeyError, TypeError) as exc:
        raise SignatureInvalidError(f"the signature does not verify: {exc}") from None
    if found.headers().get("alg") != ALGORITHM:
        raise SignatureInvalidError(f"the signature's alg is not {ALGORITHM}")
    try:
        claims: dict[str, Any] = json.loads(found.payload)
    except ValueError:
        raise SignatureInvalidError("the signed claims are not JSON") from None
    try:
        expected = trace_sha256(trace)
    except TraceNotCanonicalError as exc:
        raise SignatureInvalidError(f"the trace cannot be put in canonical form: {exc}") from None
    if claims.get("trace_sha256") != expected:
        raise SignatureInvalidError(
            f"the signature is about another trace (trace_sha256 {claims.get('trace_sha256')}, "
            f"this trace's is {expected})"
        )
    return claims
