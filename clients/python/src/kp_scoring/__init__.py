"""The kp-scoring client: `KpScoringClient` (blocking) and `AsyncKpScoringClient` score
reasoning traces against a kp-scoring service; `verify_signature` checks a signed score.

    from kp_scoring import KpScoringClient

    with KpScoringClient("http://127.0.0.1:8000") as kp:
        print(kp.evaluate(trace).score)

The `kp-scoring` command (kp_scoring.cli) does the same from a shell.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from kp_scoring.client import (
    AsyncKpScoringClient,
    FieldError,
    Forbidden,
    KpScoringClient,
    KpScoringError,
    Overloaded,
    RateLimited,
    SignatureInvalidError,
    TraceLike,
    TryLater,
    Unauthorized,
    Unreachable,
    ValidationFailed,
    trace_sha256,
    verify_signature,
)
from kp_scoring.models import CacheOut, ContributionOut, EvaluationOut, ReadyOut

try:
    __version__ = version("kp-scoring-client")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "AsyncKpScoringClient",
    "CacheOut",
    "ContributionOut",
    "EvaluationOut",
    "FieldError",
    "Forbidden",
    "KpScoringClient",
    "KpScoringError",
    "Overloaded",
    "RateLimited",
    "ReadyOut",
    "SignatureInvalidError",
    "TraceLike",
    "TryLater",
    "Unauthorized",
    "Unreachable",
    "ValidationFailed",
    "__version__",
    "trace_sha256",
    "verify_signature",
]
