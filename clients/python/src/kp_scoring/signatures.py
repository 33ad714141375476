"""Checking signed scores, for anyone holding a trace and the service's JWKS (the client, the
CLI, a registry): the JWS must verify against a key of the set (by its kid) and be about the
trace, whose `trace_sha256` is the SHA-256 of its RFC 8785 (JCS) canonical JSON, so that it is
the same whatever the trace's whitespace or key order, its numbers read as the reference SDK's
JavaScript reads them (doubles: an integer past 2**53 as the nearest one). `joserfc` checks the
JWS, the `rfc8785` package makes the canonical form. The service signs with the same hash
(tests hold the two to the same value). Beyond that, `verify` can require an issuer, an
audience and a committed score (not a dry run), refuses an expired signature (`exp`, honoured
at most `leeway_s` late: 5 s unless said), and compares every field of an answer (but
`UNSIGNED_FIELDS`) with the signed answer, the `answer` claim, and for a POST /contribution
answer every other field with its `contribution_answer` claim (the service's docs:
operating/signatures.md).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import warnings
from collections.abc import Mapping
from typing import Any

import rfc8785

__all__ = [
    "ALGORITHM",
    "CONTRIBUTION_CLAIM",
    "DEFAULT_LEEWAY_S",
    "UNSIGNED_FIELDS",
    "SignatureInvalidError",
    "TraceNotCanonicalError",
    "answer_mismatches",
    "as_javascript_reads",
    "claim_problems",
    "is_contribution_answer",
    "trace_sha256",
    "verify",
]

ALGORITHM = "EdDSA"
#: Clocks disagree: by default an `exp` is honoured this many seconds late, no more.
DEFAULT_LEEWAY_S = 5.0
#: The answer's fields the service does not sign: the time it took and the signature itself.
UNSIGNED_FIELDS = frozenset({"elapsed_ms", "signature"})
# RFC 9864 prefers the fully specified "Ed25519"; the registry asks for "EdDSA", which every
# JOSE library verifies. joserfc warns on each use: it is the choice made here.
warnings.filterwarnings("ignore", message="EdDSA is deprecated", module=r"joserfc\b")


class SignatureInvalidError(Exception):
    """A signature that does not verify, or that is not about the trace given."""


class TraceNotCanonicalError(ValueError):
    """A trace RFC 8785 cannot put in canonical form: a string holding a lone surrogate."""


_SAFE_INTEGER = 2**53


def as_javascript_reads(value: Any) -> Any:
    """`value` (parsed JSON) with its numbers as JavaScript's JSON.parse holds them, written
    back as JSON.stringify writes them: an integer past 2**53 as the nearest double, a number
    past the largest double (Infinity) and NaN as None. The service digests traces so (the
    reference SDK is JavaScript), and RFC 8785 writes numbers as doubles."""
    if isinstance(value, dict):
        return {key: as_javascript_reads(item) for key, item in value.items()}
    if isinstance(value, list):
        return [as_javascript_reads(item) for item in value]
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value
    if isinstance(value, int):
        if -_SAFE_INTEGER < value < _SAFE_INTEGER:  # RFC 8785's integers; 2**53 is a double
            return value
        try:
            return float(value)
        except OverflowError:
            return None
    return value if math.isfinite(value) else None


def trace_sha256(trace: Any) -> str:
    """Hex SHA-256 of the trace's RFC 8785 canonical JSON, its numbers as JavaScript reads
    them (`trace`: as parsed from JSON)."""
    try:
        canonical = rfc8785.dumps(trace)
    except (rfc8785.IntegerDomainError, rfc8785.FloatDomainError):
        canonical = _canonical(as_javascript_reads(trace))
    except (rfc8785.CanonicalizationError, UnicodeError) as exc:
        raise TraceNotCanonicalError(str(exc)) from None
    return hashlib.sha256(canonical).hexdigest()


def _canonical(value: Any) -> bytes:
    try:
        return rfc8785.dumps(value)
    except (rfc8785.CanonicalizationError, UnicodeError) as exc:
        raise TraceNotCanonicalError(str(exc)) from None


def verify(
    signature: str,
    trace: Any,
    jwks: dict[str, Any],
    *,
    issuer: str | None = None,
    audience: str | None = None,
    committed: bool = False,
    answer: Mapping[str, Any] | Any = None,
    now: float | None = None,
    leeway_s: float = DEFAULT_LEEWAY_S,
    contribution: Any = None,
) -> dict[str, Any]:
    """The claims of `signature` if it verifies against a key of `jwks` (by its kid), is about
    `trace` (parsed JSON, any key order) and has not expired (`exp` honoured at most
    `leeway_s` seconds late); else SignatureInvalidError saying why. Optionally also: signed
    by `issuer`; for `audience` (a signature that names an audience is refused without it); a
    `committed` score (not a dry run: the trace entered the memory); `answer` (the JSON
    answer it came in, or the client's model of it) says what the signature says: each of its
    fields but UNSIGNED_FIELDS is the signed one, and none is missing or added
    (docs/operating/signatures.md); and `contribution` (POST /contribution's) is the cleaned
    trace the signature is about (`contribution_sha256`)."""
    claims = _verified_claims(signature, trace, jwks)
    problems = claim_problems(
        claims, issuer=issuer, audience=audience, committed=committed, now=now, leeway_s=leeway_s
    )
    if answer is not None and hasattr(answer, "model_dump"):
        answer = answer.model_dump(mode="json")
    if contribution is None and isinstance(answer, Mapping) and is_contribution_answer(answer):
        contribution = answer["contribution"]
    if contribution is not None:
        problems += _contribution_problems(claims, contribution)
    if answer is not None:
        problems += answer_mismatches(claims, answer)
    if problems:
        raise SignatureInvalidError("; ".join(problems))
    return claims


def claim_problems(
    claims: dict[str, Any],
    *,
    issuer: str | None = None,
    audience: str | None = None,
    committed: bool = False,
    now: float | None = None,
    leeway_s: float = DEFAULT_LEEWAY_S,
) -> list[str]:
    """What the verified `claims` fail of the checks asked for (expiry always, honoured at
    most `leeway_s` seconds late)."""
    if leeway_s < 0:
        raise ValueError(f"leeway_s must be at least 0, got {leeway_s}")
    problems = []
    at = time.time() if now is None else now
    expiry = claims.get("exp")
    if expiry is not None and (
        isinstance(expiry, bool) or not isinstance(expiry, int | float) or at >= expiry + leeway_s
    ):
        problems.append(f"the signature expired (exp {expiry})")
    signer = claims.get("iss")
    if issuer is not None and signer != issuer:
        problems.append(
            f"the signature names no issuer, not {_json(issuer)}"
            if signer is None
            else f"the issuer is {_json(signer)}, not {_json(issuer)}"
        )
    signed_for = claims.get("aud")
    if signed_for is not None or audience is not None:
        audiences = signed_for if isinstance(signed_for, list) else [signed_for]
        if audience is None:
            problems.append(f"the signature is for the audience {_json(signed_for)}: name yours")
        elif signed_for is None:
            problems.append(
                f"the signature names no audience, not {_json(audience)} (the service names "
                "one when it has KP_SIGNING_AUDIENCE)"
            )
        elif audience not in audiences:
            problems.append(
                f"the signature is for the audience {_json(signed_for)}, not {_json(audience)}"
            )
    if committed and claims.get("dry_run") is not False:
        problems.append(
            "the score is of a dry run (the trace did not enter the memory)"
            if claims.get("dry_run") is True
            else "the signature does not say the trace entered the memory (no dry_run claim)"
        )
    return problems


#: A POST /contribution answer's fields beside its evaluation are signed in this claim; its
#: evaluation is the `answer` claim, its `contribution` the `contribution_sha256` claim.
CONTRIBUTION_CLAIM = "contribution_answer"


def is_contribution_answer(answer: Any) -> bool:
    """Whether `answer` (JSON) is a POST /contribution answer: an evaluation and a
    contribution."""
    return (
        isinstance(answer, Mapping)
        and isinstance(answer.get("evaluation"), Mapping)
        and "contribution" in answer
    )


def answer_mismatches(claims: dict[str, Any], answer: Mapping[str, Any] | Any) -> list[str]:
    """Where the answer differs from the signed one (an answer edited after signing): a
    field whose value is not the signed one, a signed field it lacks, a field it adds.
    `answer`: the JSON answer, or a model of it (anything with pydantic's `model_dump`); a
    POST /contribution answer is compared whole: its evaluation with the `answer` claim
    (named evaluation.score, ...), every other field but `contribution` (checked by its
    digest) with the contribution_answer claim (shareable, redactions.0.type, ...)."""
    if hasattr(answer, "model_dump"):
        answer = answer.model_dump(mode="json")
    signed = claims.get("answer")
    if not isinstance(signed, dict):
        return ["the signature covers no answer (the `answer` claim): the answer cannot be checked"]
    if not isinstance(answer, Mapping):
        return [f"the answer is not a JSON object: {type(answer).__name__}"]
    if not is_contribution_answer(answer):
        shown = {k: v for k, v in answer.items() if k not in UNSIGNED_FIELDS}
        return _differences((), shown, signed)
    evaluation = answer["evaluation"]
    shown = {k: v for k, v in evaluation.items() if k not in UNSIGNED_FIELDS}
    problems = _differences(("evaluation",), shown, signed)
    signed_rest = claims.get(CONTRIBUTION_CLAIM)
    if not isinstance(signed_rest, dict):
        return [
            *problems,
            "the signature covers only this /contribution answer's evaluation (no "
            f"{CONTRIBUTION_CLAIM} claim): its shareable, redactions, findings and injection "
            "verdicts cannot be checked",
        ]
    rest = {k: v for k, v in answer.items() if k not in ("evaluation", "contribution")}
    return problems + _differences((), rest, signed_rest)


def _differences(path: tuple[str, ...], shown: Any, signed: Any) -> list[str]:
    """Each place where `shown` is not `signed`, named by its dotted path (list items by
    index: novelty.nearest.trace_id, overrides.0)."""
    if isinstance(shown, Mapping) and isinstance(signed, dict):
        problems = []
        for key in [*signed, *(k for k in shown if k not in signed)]:
            where = ".".join((*path, str(key)))
            if key not in shown:
                problems.append(f"the answer lacks {where}, signed as {_json(signed[key])}")
            elif key not in signed:
                problems.append(f"the answer's {where} is not signed")
            else:
                problems += _differences((*path, str(key)), shown[key], signed[key])
        return problems
    if isinstance(shown, list) and isinstance(signed, list) and len(shown) == len(signed):
        return [
            problem
            for i, (item, signed_item) in enumerate(zip(shown, signed, strict=True))
            for problem in _differences((*path, str(i)), item, signed_item)
        ]
    if _same(shown, signed):
        return []
    return [f"the answer's {'.'.join(path)} is {_json(shown)}, the signed one {_json(signed)}"]


def _json(value: Any) -> str:
    """A value in a message as JSON writes it (null, true, "text"), never as Python would."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):  # not JSON (a model given as the answer): its own text
        return str(value)


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON values: 1 and 1.0 are, true and 1 are not."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _verified_claims(signature: str, trace: Any, jwks: dict[str, Any]) -> dict[str, Any]:
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


def _contribution_problems(claims: dict[str, Any], contribution: Any) -> list[str]:
    signed = claims.get("contribution_sha256")
    if signed is None:
        return ["the signature is about no contribution (no contribution_sha256 claim)"]
    try:
        expected = trace_sha256(contribution)
    except TraceNotCanonicalError as exc:
        return [f"the contribution cannot be put in canonical form: {exc}"]
    if signed != expected:
        return [
            f"the signature is about another contribution (contribution_sha256 {signed}, this "
            f"contribution's is {expected})"
        ]
    return []
