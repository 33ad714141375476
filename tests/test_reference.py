"""Differential tests against the reference SDK's own outputs (tests/fixtures/reference/README.md).

The reference scored these traces; the service must give the same scores within 1e-6, the same
tokens, and the same vectors to float32 rounding (the differences of docs/scoring.md aside: see
expected_score).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.domain import scoring
from app.embedding.onnx_embedder import MAX_TOKENS, OnnxEmbedder
from app.schemas.trace import ReasoningTrace
from tests.conftest import ClientFactory, load_fixture

SCORE_TOLERANCE = 1e-6
NO_EMBEDDER = load_fixture("no_embedder.json")["cases"]
SEQUENCE = load_fixture("embedder_sequence.json")["cases"]
TOKENIZER = load_fixture("tokenizer_cases.json")["cases"]


def test_the_corpora_cover_what_the_issue_asks() -> None:
    assert len(NO_EMBEDDER) >= 300
    assert len(SEQUENCE) >= 100
    domains = {c["trace"]["metadata"]["task_domain"] for c in NO_EMBEDDER}
    assert set(scoring.WEIGHT_PROFILES) <= domains
    assert {"constructor", "__proto__"} <= domains
    assert max(len(c["trace"]["steps"]) for c in NO_EMBEDDER) > 40
    assert sum(c["truncated"] for c in SEQUENCE) >= 5
    assert max(c["token_count"] for c in SEQUENCE) > 2000


def test_no_embedder_corpus_scores_equal_the_reference() -> None:
    mismatches = []
    for case in NO_EMBEDDER:
        t = ReasoningTrace.model_validate(case["trace"])
        got = scoring.score(
            t.steps,
            novelty=scoring.NEUTRAL_NOVELTY,
            confidence=t.outcome.confidence,
            success=t.metadata.success,
            task_domain=t.metadata.task_domain,
        ).value
        if abs(got - case["expected_score"]) > SCORE_TOLERANCE:
            mismatches.append((case["name"], got, case["expected_score"]))
    assert mismatches == []


# Names a plain JavaScript object inherits: the reference's weight lookup finds these.
OBJECT_PROTOTYPE_NAMES = {
    "__proto__", "__defineGetter__", "__defineSetter__", "__lookupGetter__", "__lookupSetter__",
    "constructor", "hasOwnProperty", "isPrototypeOf", "propertyIsEnumerable", "toLocaleString",
    "toString", "valueOf",
}  # fmt: skip


def test_reference_disagrees_only_where_the_spec_says() -> None:
    """expected_score differs from the reference's own only for Object.prototype domain names."""
    differing = {
        case["trace"]["metadata"]["task_domain"]
        for case in NO_EMBEDDER
        if case["reference_score"] != case["expected_score"]
    }
    assert differing
    assert differing <= OBJECT_PROTOTYPE_NAMES


def test_no_embedder_corpus_over_http(client_no_embedder: TestClient) -> None:
    traces = [case["trace"] for case in NO_EMBEDDER]
    got: list[float] = []
    for start in range(0, len(traces), 64):
        r = client_no_embedder.post("/evaluate/batch", json={"traces": traces[start : start + 64]})
        assert r.status_code == 200, r.text
        got += [res["score"] for res in r.json()["results"]]
        assert all(
            res["novelty"]["reason"] == "embedder_unavailable" for res in r.json()["results"]
        )
    expected = [case["expected_score"] for case in NO_EMBEDDER]
    np.testing.assert_allclose(got, expected, rtol=0, atol=SCORE_TOLERANCE)
    assert client_no_embedder.get("/cache").json()["size"] == 0


@pytest.mark.parametrize("case", TOKENIZER, ids=lambda c: repr(c["text"][:30]))
def test_tokenization_equals_transformers_js(embedder: OnnxEmbedder, case: dict[str, Any]) -> None:
    (tokens,) = embedder.tokenize([case["text"]])
    assert tokens.ids == case["input_ids"]
    # The fixture counts the whole text's tokens; the service counts those the model reads.
    assert len(tokens.ids) == min(case["token_count"], MAX_TOKENS)
    assert tokens.truncated == (case["token_count"] > MAX_TOKENS)


@pytest.mark.slow
def test_vectors_equal_the_reference_to_float32_rounding(embedder: OnnxEmbedder) -> None:
    texts = [case["text"] for case in SEQUENCE]
    vectors = np.vstack([embedder.embed([text]) for text in texts])
    reference = np.asarray([case["embedding"] for case in SEQUENCE], dtype=np.float32)
    # A few float32 ulps: the reference runs onnxruntime-node, we run onnxruntime for Python.
    np.testing.assert_allclose(vectors, reference, rtol=0, atol=2e-6)
    cosines = (vectors.astype(np.float64) * reference).sum(axis=1)
    assert cosines.min() > 1 - 1e-6


@pytest.mark.slow
def test_embedder_sequence_over_http_equals_the_reference(make_client: ClientFactory) -> None:
    """The whole sequence, in order, through the real service with the packaged int8 model."""
    client = make_client()
    for case in SEQUENCE:
        r = client.post("/evaluate", json=case["trace"])
        assert r.status_code == 200, r.text
        body = r.json()
        novelty = body["novelty"]
        assert body["score"] == pytest.approx(case["expected_score"], abs=SCORE_TOLERANCE), case[
            "name"
        ]
        assert novelty["cache_size"] == case["cache_size_before"]
        assert novelty["tokens"] == min(case["token_count"], MAX_TOKENS)
        assert novelty["truncated"] == case["truncated"] == (case["token_count"] > MAX_TOKENS)
        if case["max_cosine_before"] is None:
            assert novelty == {
                **novelty,
                "measured": False,
                "reason": "cache_empty",
                "max_cosine": None,
            }
        else:
            assert novelty["measured"] is True
            assert novelty["max_cosine"] == pytest.approx(case["max_cosine_before"], abs=1e-6)
    assert client.get("/cache").json()["size"] == len(SEQUENCE)
