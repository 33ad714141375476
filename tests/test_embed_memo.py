"""One model run per text (KP_EMBED_MEMO_CAPACITY), with the real model: a commit after a dry
run and a retry run no model, and every answer is what the service without the memo gives."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.core.config import Settings
from app.embedding.embeddings import EmbeddingMemo
from app.embedding.types import Embedding
from app.main import create_app
from tests.conftest import ClientFactory
from tests.factories import make_trace, step


def runs(client: TestClient) -> int:
    embeddings = client.app.state.service.runtime.embeddings  # type: ignore[attr-defined]
    return sum(embeddings.scheduler.runs_total.values())


def traces() -> list[dict[str, Any]]:
    a = make_trace(trace_id="kp:trace:a", objective="Find the leak in the connection pool")
    b = make_trace(
        trace_id="kp:trace:b",
        objective="Port the billing job to the new scheduler",
        steps=[step(0, "thought", "read the cron table"), step(1, "observation", "two jobs")],
    )
    return [a, b]


def without_time(answer: dict[str, Any]) -> dict[str, Any]:
    """The answer less what depends on the clock: the time taken and the nearest entry's age."""
    kept = {k: v for k, v in answer.items() if k != "elapsed_ms"}
    nearest = kept["novelty"].get("nearest")
    if nearest is not None:
        kept["novelty"] = {**kept["novelty"], "nearest": {**nearest, "age_ms": None}}
    return kept


def test_a_commit_after_a_dry_run_runs_no_model(make_client: ClientFactory) -> None:
    client = make_client(embedder_preload=True)
    a, _ = traces()
    dry = client.post("/evaluate", json=a, params={"dry_run": "true"})
    assert dry.status_code == 200
    before = runs(client)
    commit = client.post("/evaluate", json=a)
    assert runs(client) == before
    committed, dry_answer = without_time(commit.json()), without_time(dry.json())
    # The same score; only whether the trace was stored differs.
    assert committed["novelty"].pop("stored") is True
    assert dry_answer["novelty"].pop("stored") is False
    assert committed["novelty"].pop("not_stored") is None
    assert dry_answer["novelty"].pop("not_stored") == "dry_run"
    assert committed == dry_answer
    retry = client.post("/evaluate", json=a)
    assert runs(client) == before
    assert retry.json()["novelty"]["max_cosine"] == pytest.approx(1.0, abs=1e-6)
    metrics = client.get("/metrics").text
    assert 'kp_embed_memo_total{result="hit"} 2.0' in metrics


def test_answers_are_those_of_the_service_without_the_memo(make_client: ClientFactory) -> None:
    with_memo = make_client(embedder_preload=True)
    without = make_client(embedder_preload=True, embed_memo_capacity=0)
    a, b = traces()
    sequence = [(a, True), (a, False), (b, False), (a, False), (b, True)]
    for trace, dry_run in sequence:
        params = {"dry_run": "true"} if dry_run else {}
        got = with_memo.post("/evaluate", json=trace, params=params).json()
        expected = without.post("/evaluate", json=trace, params=params).json()
        assert without_time(got) == without_time(expected)
    batch = {"traces": [a, b, a]}
    got = with_memo.post("/evaluate/batch", json=batch, params={"dry_run": "true"}).json()
    expected = without.post("/evaluate/batch", json=batch, params={"dry_run": "true"}).json()
    assert [without_time(r) for r in got["results"]] == [
        without_time(r) for r in expected["results"]
    ]


class CountingEmbedder:
    def __init__(self) -> None:
        self.texts: list[str] = []

    async def embed(self, texts: Any) -> list[Embedding]:
        self.texts += list(texts)
        return [Embedding(np.full(384, len(t), dtype=np.float32), len(t), False) for t in texts]


def test_the_memo_is_bounded_and_a_text_twice_in_one_request_runs_once() -> None:
    """The bookkeeping alone (which texts reach the embedder), with a stand-in embedder."""
    inner = CountingEmbedder()
    memo = EmbeddingMemo(inner, capacity=2)
    first = asyncio.run(memo.embed(["x", "yy", "x"]))
    assert inner.texts == ["x", "yy"]
    assert first[0] is first[2]
    asyncio.run(memo.embed(["zzz"]))  # evicts "x", the least recently used
    assert len(memo) == 2
    asyncio.run(memo.embed(["yy", "x"]))
    assert inner.texts == ["x", "yy", "zzz", "x"]


def test_concurrent_requests_for_one_new_text_share_one_model_run() -> None:
    async def scenario() -> None:
        app = create_app(Settings(embedder_preload=True))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://kp") as client:
                embeddings = app.state.service.runtime.embeddings
                before = sum(embeddings.scheduler.runs_total.values())
                trace = make_trace(objective="Shared run for eight copies of one text")
                answers = await asyncio.gather(
                    *(
                        client.post("/evaluate", json=trace, params={"dry_run": "true"})
                        for _ in range(8)
                    )
                )
                assert [r.status_code for r in answers] == [200] * 8
                assert sum(embeddings.scheduler.runs_total.values()) == before + 1
                assert len({r.json()["novelty"]["tokens"] for r in answers}) == 1

    asyncio.run(scenario())


class GatedEmbedder(CountingEmbedder):
    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def embed(self, texts: Any) -> list[Embedding]:
        await self.gate.wait()
        return await super().embed(texts)


def test_a_text_waited_for_is_embedded_anew_if_its_runner_goes_away() -> None:
    async def scenario() -> None:
        inner = GatedEmbedder()
        memo = EmbeddingMemo(inner, capacity=8)
        runner = asyncio.create_task(memo.embed(["x"]))
        await asyncio.sleep(0)
        waiter = asyncio.create_task(memo.embed(["x"]))
        await asyncio.sleep(0)
        runner.cancel()  # its client went away
        inner.gate.set()
        (got,) = await waiter
        assert got.token_count == 1
        assert inner.texts == ["x"]  # the cancelled run never reached the model

    asyncio.run(scenario())
