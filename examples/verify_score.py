"""What a registry checks before it trusts a signed score, with PyJWT and rfc8785 only.

    python examples/verify_score.py TRACE.json ANSWER.json JWKS_URL_OR_FILE \
        --issuer kp-scoring --audience my-registry

Exit 0: the score can be trusted; 1: it cannot (the reason on stderr). The checks:

1. The signature verifies with the service's published key named by its `kid`, alg EdDSA.
2. It was made by the issuer you expect (`iss`) for you (`aud`, when the service signs one)
   and has not expired (`exp`, when the service sets a lifetime).
3. It is about this trace: `trace_sha256` is the SHA-256 of its RFC 8785 canonical JSON, its
   numbers read as JavaScript reads them (an integer of 2**53 or more as a double).
4. The trace entered the memory: `dry_run` is false (a dry run leaves it out, so copies of
   it would still score as novel).
5. The answer says what the signature says: the signed `answer` claim is the answer's every
   field but elapsed_ms and the signature, so a field edited, added or removed is refused.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import urllib.request
from typing import Any

import jwt
import rfc8785

#: The answer's fields the service does not sign.
UNSIGNED_FIELDS = {"elapsed_ms", "signature"}


def as_javascript_reads(value: Any) -> Any:
    """Numbers as the reference SDK's JavaScript holds them (RFC 8785 writes doubles): an
    integer past 2**53 as a double, past every double (Infinity) or NaN as null."""
    if isinstance(value, dict):
        return {k: as_javascript_reads(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_javascript_reads(v) for v in value]
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value
    if isinstance(value, int) and abs(value) < 2**53:
        return value
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def load_jwks(where: str) -> dict[str, Any]:
    if where.startswith(("http://", "https://")):
        with urllib.request.urlopen(where, timeout=10) as answer:
            jwks: dict[str, Any] = json.load(answer)
            return jwks
    with open(where, encoding="utf-8") as file:
        jwks = json.load(file)
        return jwks


def check(
    trace: Any, answer: dict[str, Any], jwks: dict[str, Any], issuer: str, audience: str | None
) -> dict[str, Any]:
    """The signed claims, or ValueError saying which check failed."""
    token = answer.get("signature")
    if not isinstance(token, str):
        raise ValueError("the answer is not signed")
    try:
        kid = jwt.get_unverified_header(token)["kid"]
        key = jwt.PyJWKSet.from_dict(jwks)[kid]
        # 1 and 2: PyJWT checks the signature, iss, aud and exp (aud is required when given).
        claims: dict[str, Any] = jwt.decode(
            token,
            key.key,
            algorithms=["EdDSA"],
            issuer=issuer,
            audience=audience,
            options={"require": ["iss", "iat"], "verify_aud": audience is not None},
        )
    except (jwt.PyJWTError, KeyError) as exc:
        raise ValueError(f"the signature does not verify: {exc}") from None
    if audience is None and "aud" in claims:
        raise ValueError(f"the score is for the audience {claims['aud']!r}, not for us")
    # 3
    expected = hashlib.sha256(rfc8785.dumps(as_javascript_reads(trace))).hexdigest()
    if claims.get("trace_sha256") != expected:
        raise ValueError("the signature is about another trace")
    # 4
    if claims.get("dry_run") is not False:
        raise ValueError("the score is of a dry run: the trace did not enter the memory")
    # 5: compared in canonical form, so that key order and 1 against 1.0 do not matter
    shown = {k: v for k, v in answer.items() if k not in UNSIGNED_FIELDS}
    signed = claims.get("answer")
    if not isinstance(signed, dict):
        raise ValueError("the signature covers no answer")
    for field in sorted(shown.keys() | signed.keys()):
        if field not in shown or field not in signed:
            raise ValueError(f"the answer's {field} is missing or not signed")
        if rfc8785.dumps(shown[field]) != rfc8785.dumps(signed[field]):
            raise ValueError(f"the answer's {field} is not the signed one")
    return claims


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check a signed score as a registry would.")
    parser.add_argument("trace", help="the trace as it was sent (JSON file)")
    parser.add_argument("answer", help="the service's answer (JSON file)")
    parser.add_argument("jwks", help="the service's /.well-known/jwks.json (URL or file)")
    parser.add_argument("--issuer", default="kp-scoring", help="the iss you expect")
    parser.add_argument("--audience", help="your name, when the service signs an aud")
    args = parser.parse_args(argv)
    with open(args.trace, encoding="utf-8") as file:
        trace = json.load(file)
    with open(args.answer, encoding="utf-8") as file:
        answer = json.load(file)
    try:
        claims = check(trace, answer, load_jwks(args.jwks), args.issuer, args.audience)
    except ValueError as exc:
        print(f"refused: {exc}", file=sys.stderr)
        return 1
    print(f"trusted: {claims['answer']['trace_id']} scored {claims['answer']['score']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
