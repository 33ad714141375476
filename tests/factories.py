"""Trace builders shared by the tests (and the bench), and lines of the cache's export."""

from __future__ import annotations

import base64
import copy
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

CONTEXT = "https://openknowledgepulse.org/schema/v1"


def step(
    step_id: int, type_: str = "thought", content: str | None = None, tool: str | None = None
) -> dict[str, Any]:
    s: dict[str, Any] = {"step_id": step_id, "type": type_}
    if content is not None:
        s["content"] = content
    if tool is not None:
        s["tool"] = {"name": tool}
    return s


def make_trace(
    *,
    steps: list[dict[str, Any]] | None = None,
    objective: str = "Review PR #42 for security issues",
    domain: str = "default",
    success: bool = True,
    confidence: float = 1.0,
    trace_id: str = "kp:trace:test-0001",
) -> dict[str, Any]:
    """A valid trace; by default docs/scoring.md's worked example (0.57625 with no embedder)."""
    return {
        "@context": CONTEXT,
        "@type": "ReasoningTrace",
        "id": trace_id,
        "metadata": {
            "created_at": "2025-06-15T10:00:00.000Z",
            "task_domain": domain,
            "success": success,
            "quality_score": 0,
            "visibility": "network",
            "privacy_level": "aggregated",
        },
        "task": {"objective": objective},
        "steps": copy.deepcopy(steps)
        if steps is not None
        else [
            step(0, "thought", "Analyzing diff for injection vectors"),
            step(1, "tool_call", "Reading the PR", tool="search"),
            step(2, "observation", "Found unsanitized SQL in handler.ts"),
        ],
        "outcome": {"result_summary": "Done", "confidence": confidence},
    }


#: Distinct everyday objectives, for tests that need several traces unlike each other.
TOPICS = [
    "Reconcile the Q3 ledger against bank statements",
    "Debug a flaky integration test in the CI pipeline",
    "Triage a patient's chest pain symptoms",
    "Answer a refund request for a damaged parcel",
    "Tune the autovacuum settings of a busy database",
    "Write a haiku about autumn leaves",
    "Plan a three-day trip to Kyoto in spring",
    "Estimate the carbon footprint of a data centre",
    "Review a pull request for SQL injection",
    "Summarise a paper on protein folding",
    "Design a schema for an event ticketing system",
    "Compare two mortgage offers with different fees",
]


# -- lines of GET /cache/export, as POST /cache/import takes them --------------


def vector_b64(vector: npt.ArrayLike) -> str:
    """A vector as the export writes it: little-endian float32, base64."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()


def export_line(trace_id: str, vector: npt.ArrayLike, added_at_ms: float) -> dict[str, Any]:
    return {"trace_id": trace_id, "added_at_ms": added_at_ms, "vector": vector_b64(vector)}


def random_units(count: int, seed: int, dims: int = 384) -> npt.NDArray[np.float32]:
    """`count` seeded random unit vectors (float32 rows)."""
    rows = np.random.default_rng(seed).standard_normal((count, dims)).astype("<f4")
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    return rows


def import_body(count: int, *, seed: int, id_prefix: str, dims: int = 384) -> bytes:
    """An import of `count` random unit vectors, ids `id_prefix` + their index, one line each."""
    return b"".join(
        orjson.dumps(export_line(f"{id_prefix}{i}", v, 1e12 + i)) + b"\n"
        for i, v in enumerate(random_units(count, seed, dims))
    )
