"""What a signed score says (its claims: docs/operating/signatures.md). app/service/signing.py
signs; the client's `kp_scoring.signatures` (clients/python) hashes traces the same way:
tests/test_signatures.py holds the two to one value.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import rfc8785

from app.core.errors import Loc, Problem, ServiceError

ALGORITHM = "EdDSA"
# RFC 9864 prefers the fully specified "Ed25519"; the registry and the issue ask for "EdDSA",
# which every JOSE library verifies. joserfc warns on each use: it is the choice made here.
warnings.filterwarnings("ignore", message="EdDSA is deprecated", module=r"joserfc\b")


#: The answer's fields a signature does not cover: the time it took (not a claim about the
#: trace) and the signature itself.
UNSIGNED_FIELDS = frozenset({"elapsed_ms", "signature"})


def signed_answer(answer: Mapping[str, Any]) -> dict[str, Any]:
    """The `answer` claim: the answer's JSON fields but UNSIGNED_FIELDS."""
    return {k: v for k, v in answer.items() if k not in UNSIGNED_FIELDS}


#: POST /contribution's answer around its evaluation: the fields its signature covers in the
#: CONTRIBUTION_CLAIM claim (the evaluation is the `answer` claim; the cleaned trace, which
#: may be a megabyte, is covered by its digest).
CONTRIBUTION_CLAIM = "contribution_answer"
NOT_IN_CONTRIBUTION_CLAIM = frozenset({"evaluation", "contribution"})


def contribution_claims(answer: Mapping[str, Any], contribution: Any) -> dict[str, Any]:
    """A /contribution answer's own claims: `contribution_sha256` (the cleaned trace's digest)
    and CONTRIBUTION_CLAIM, every field of the answer as the API shows it (`answer`) but
    NOT_IN_CONTRIBUTION_CLAIM, any field the answer gains included."""
    return {
        "contribution_sha256": trace_sha256(contribution),
        CONTRIBUTION_CLAIM: {k: v for k, v in answer.items() if k not in NOT_IN_CONTRIBUTION_CLAIM},
    }


_SAFE_INTEGER = 2**53


def as_javascript_reads(value: Any) -> Any:
    """`value` (parsed JSON) with its numbers as JavaScript's JSON.parse holds them, written
    back as JSON.stringify writes them: an integer past 2**53 as the nearest double, a number
    past the largest double (Infinity) and NaN as None."""
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
    """Hex SHA-256 of the trace's RFC 8785 canonical JSON (`trace`: as parsed), its numbers
    as JavaScript reads them: RFC 8785 refuses an integer past 2**53, the SDK sends one."""
    try:
        try:
            canonical = rfc8785.dumps(trace)
        except (rfc8785.IntegerDomainError, rfc8785.FloatDomainError):
            # Rare (a number past what JSON's doubles hold): only then the copy.
            canonical = rfc8785.dumps(as_javascript_reads(trace))
    except (rfc8785.CanonicalizationError, UnicodeError) as exc:  # a lone surrogate
        msg = f"cannot be signed: not I-JSON (RFC 8785): {exc}"
        raise ServiceError(422, "not_canonicalizable", msg, loc=()) from None
    return hashlib.sha256(canonical).hexdigest()


def trace_digests(traces: Sequence[Any], *, batch: bool, at: Loc = ()) -> list[str]:
    """Each trace's `trace_sha256`, or ServiceError (422) naming every trace RFC 8785 cannot
    make canonical, at `at` (a batch's i-th trace at `at` + traces, i): with signing on, such a
    trace is refused before it is scored."""
    digests, problems = [], []
    for i, trace in enumerate(traces):
        try:
            digests.append(trace_sha256(trace))
        except ServiceError as exc:
            loc = (*at, "traces", i) if batch else tuple(at)
            problems.append(Problem(loc, exc.message, exc.kind))
    if problems:
        raise ServiceError(422, problems[0].type, problems[0].msg, problems=problems)
    return digests
