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

from app.core.errors import Loc, field_error

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


class TraceNotCanonicalError(ValueError):
    """A trace RFC 8785 cannot put in canonical form (an integer past 2**53, say)."""


def trace_sha256(trace: Any) -> str:
    """Hex SHA-256 of the trace's RFC 8785 canonical JSON (`trace`: as parsed from JSON)."""
    try:
        canonical = rfc8785.dumps(trace)
    except (rfc8785.CanonicalizationError, UnicodeError) as exc:
        raise TraceNotCanonicalError(str(exc)) from None
    return hashlib.sha256(canonical).hexdigest()


def unsignable_errors(traces: Sequence[Any], *, batch: bool, at: Loc = ()) -> list[dict[str, Any]]:
    """With signing on, a trace RFC 8785 cannot make canonical (its hash is what is signed) is
    refused before scoring: an error entry for each such trace, at `at` (a batch's i-th trace
    at `at` + traces, i)."""
    errors = []
    for i, trace in enumerate(traces):
        try:
            trace_sha256(trace)
        except TraceNotCanonicalError as exc:
            msg = f"cannot be signed: not I-JSON (RFC 8785): {exc}"
            loc = [*at, "traces", i] if batch else list(at)
            errors.append(field_error(loc, msg, "not_canonicalizable"))
    return errors
