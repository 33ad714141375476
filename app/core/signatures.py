"""What a signed score says: `answer`, every field of the answer as the API shows it but
`UNSIGNED_FIELDS` (how long it took, and the signature itself), so that a field the answer
gains is signed without a change of format; and what it is about: `trace_sha256`, the SHA-256
of the trace's RFC 8785 (JCS) canonical JSON, so that it is the same whatever the trace's
whitespace or key order (the `rfc8785` package makes the canonical form).
app/service/signing.py signs. Checking a
signature is the client's (`kp_scoring.signatures.verify`, clients/python), which hashes the
same way: tests/test_signatures.py holds the two to the same value.
"""

from __future__ import annotations

import hashlib
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


class TraceNotCanonicalError(ServiceError):
    """A trace RFC 8785 cannot put in canonical form (an integer past 2**53, say)."""

    def __init__(self, problem: str) -> None:
        msg = f"cannot be signed: not I-JSON (RFC 8785): {problem}"
        super().__init__(422, "not_canonicalizable", msg, loc=())


def trace_sha256(trace: Any) -> str:
    """Hex SHA-256 of the trace's RFC 8785 canonical JSON (`trace`: as parsed from JSON)."""
    try:
        canonical = rfc8785.dumps(trace)
    except (rfc8785.CanonicalizationError, UnicodeError) as exc:
        raise TraceNotCanonicalError(str(exc)) from None
    return hashlib.sha256(canonical).hexdigest()


def trace_digests(traces: Sequence[Any], *, batch: bool, at: Loc = ()) -> list[str]:
    """Each trace's `trace_sha256`, or ServiceError (422) naming every trace RFC 8785 cannot
    make canonical, at `at` (a batch's i-th trace at `at` + traces, i): with signing on, such a
    trace is refused before it is scored."""
    digests, problems = [], []
    for i, trace in enumerate(traces):
        try:
            digests.append(trace_sha256(trace))
        except TraceNotCanonicalError as exc:
            loc = (*at, "traces", i) if batch else tuple(at)
            problems.append(Problem(loc, exc.message, exc.kind))
    if problems:
        raise ServiceError(422, problems[0].type, problems[0].msg, problems=problems)
    return digests
