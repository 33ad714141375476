"""The request bodies the OpenAPI document shows, so that Swagger UI's "Try it out" starts from
a body the service scores (200) rather than from one built from the schema's types, which
fails validation: the trace of the KnowledgePulse documentation's example
(examples/trace.json; tests/test_openapi.py holds the two equal and posts each example)."""

from __future__ import annotations

from typing import Any

TRACE: dict[str, Any] = {
    "@context": "https://openknowledgepulse.org/schema/v1",
    "@type": "ReasoningTrace",
    "id": "kp:trace:550e8400-e29b-41d4-a716-446655440000",
    "metadata": {
        "created_at": "2025-06-15T10:00:00.000Z",
        "task_domain": "code-review",
        "success": True,
        "quality_score": 0,
        "visibility": "network",
        "privacy_level": "aggregated",
    },
    "task": {"objective": "Review PR #42 for security issues"},
    "steps": [
        {"step_id": 0, "type": "thought", "content": "Analyzing diff for injection vectors"},
        {
            "step_id": 1,
            "type": "tool_call",
            "tool": {"name": "github_pr_read"},
            "input": {"pr": 42},
        },
        {"step_id": 2, "type": "observation", "content": "Found unsanitized SQL in handler.ts"},
    ],
    "outcome": {
        "result_summary": "Identified 1 critical SQL injection vulnerability",
        "confidence": 1.0,
    },
}

EVALUATE: dict[str, dict[str, Any]] = {
    "code_review": {
        "summary": "A code review in three steps (examples/trace.json)",
        "description": "Scores 0.57625 against an empty memory; sent again, 0.40125.",
        "value": TRACE,
    }
}

BATCH: dict[str, dict[str, Any]] = {
    "twice": {
        "summary": "The same trace twice: the second is compared with the first",
        "value": {"traces": [TRACE, {**TRACE, "id": "kp:trace:550e8400-second"}]},
    }
}
