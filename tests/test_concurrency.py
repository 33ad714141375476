"""Concurrent requests equal some one-at-a-time order of the same requests (docs/scoring.md)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi import FastAPI

from app.core.config import Settings
from app.core.states import EmbedderState
from app.embedding import model_files
from app.embedding.embeddings import EmbeddingService
from app.embedding.onnx_embedder import OnnxEmbedder
from app.embedding.types import EmbedderUnavailableError, OverloadedError
from app.main import create_app
from tests.conftest import fail_embedding_on, hold_runs
from tests.factories import TOPICS, make_trace, step
from tests.server import running_server


@asynccontextmanager
async def served(**settings: Any) -> AsyncIterator[tuple[httpx.AsyncClient, FastAPI]]:
    """A started app and a client of it (the app for the tests that reach its services)."""
    app = create_app(Settings(**settings))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kp") as client:
            yield client, app


@asynccontextmanager
async def service(**settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with served(**settings) as (client, _):
        yield client


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())


async def until(condition: Callable[[], bool]) -> None:
    """Waits for a state the test has arranged to come (the timeout only stops a broken test
    from hanging; it is no assertion about speed)."""

    async def poll() -> None:
        # The state is the worker threads' (no event to await): polling it is the test's job.
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), timeout=120)


def real_embeddings(*, workers: int = 1, **limits: Any) -> EmbeddingService:
    """The embedding service on the packaged model, without the HTTP app around it."""
    files = model_files.resolve(None, None)
    return EmbeddingService(
        lambda: OnnxEmbedder(files.model, files.tokenizer, concurrent_runs=workers, defer=True),
        model_name="test",
        workers=workers,
        **limits,
    )


def test_32_clients_posting_the_same_new_trace_see_one_empty_cache() -> None:
    async def scenario() -> None:
        async with service() as client:
            await client.post("/evaluate", json=make_trace(objective="warm the model up"))
            await client.delete("/cache")
            trace = make_trace(objective="A brand new trace that nobody has seen")
            responses = await asyncio.gather(
                *(client.post("/evaluate", json=trace) for _ in range(32))
            )
            assert all(r.status_code == 200 for r in responses)
            novelty = [r.json()["novelty"] for r in responses]
            assert sum(n["reason"] == "cache_empty" for n in novelty) == 1
            measured = [
                r.json()["dimensions"]["novelty"]
                for r in responses
                if r.json()["novelty"]["measured"]
            ]
            assert len(measured) == 31
            assert max(measured) < 1e-6
            assert sorted(n["cache_size"] for n in novelty) == list(range(32))
            assert (await client.get("/cache")).json()["size"] == 32

    run(scenario)


@pytest.mark.parametrize("capacity", [pytest.param(1000, marks=pytest.mark.slow), 5])
def test_concurrent_distinct_traces_equal_a_sequential_order(capacity: int) -> None:
    traces = [
        make_trace(
            trace_id=f"kp:trace:{i}",
            objective=topic,
            steps=[
                step(0, "thought", topic.lower()),
                step(1, "tool_call", "look it up", f"t{i % 3}"),
            ],
        )
        for i, topic in enumerate(TOPICS)
    ]

    async def scenario() -> None:
        async with service(cache_capacity=capacity) as client:
            concurrent = await asyncio.gather(*(client.post("/evaluate", json=t) for t in traces))
            assert all(r.status_code == 200 for r in concurrent)
            stats = (await client.get("/cache")).json()
            assert stats["size"] == min(len(traces), capacity)
            assert stats["adds_total"] == len(traces)
            # The order the service applied them in: the number of adds each one saw.
            results = {r.json()["trace_id"]: r.json() for r in concurrent}
            if capacity >= len(traces):
                order = sorted(results, key=lambda tid: results[tid]["novelty"]["cache_size"])
                assert [results[t]["novelty"]["cache_size"] for t in order] == list(
                    range(len(traces))
                )
            else:
                return  # sizes saturate; the large-capacity case checks the replay

        async with service(cache_capacity=capacity) as fresh:
            by_id = {t["id"]: t for t in traces}
            for trace_id in order:
                replay = (await fresh.post("/evaluate", json=by_id[trace_id])).json()
                assert replay["score"] == results[trace_id]["score"]
                assert replay["novelty"]["max_cosine"] == results[trace_id]["novelty"]["max_cosine"]

    run(scenario)


@pytest.mark.slow
def test_health_answers_while_traces_wait_for_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model runs off the event loop: with every run held in progress, /healthz answers
    before any of the traces does."""
    long_trace = make_trace(steps=[step(0, "thought", "word " * 600)])

    async def scenario() -> None:
        async with served(embedder_preload=True) as (client, app):
            embeddings = app.state.service.runtime.embeddings
            gate = hold_runs(monkeypatch, embeddings)
            # Should the loop ever block on a run, this lets the test end (and fail).
            safety = threading.Timer(60, gate.set)
            safety.start()
            scoring = [
                asyncio.create_task(client.post("/evaluate", json=long_trace)) for _ in range(8)
            ]
            await until(lambda: not embeddings.scheduler.idle_workers)
            health = await client.get("/healthz")
            pending = sum(not task.done() for task in scoring)
            gate.set()
            safety.cancel()
            answers = await asyncio.gather(*scoring)
            assert health.status_code == 200
            assert pending == len(scoring)
            assert [a.status_code for a in answers] == [200] * len(scoring)

    run(scenario)


def test_one_failing_input_among_concurrent_requests_fails_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def scenario() -> None:
        async with served(embedder_preload=True) as (client, app):
            fail_embedding_on(monkeypatch, app.state.service.runtime.embeddings, "KABOOM")
            traces = [make_trace(objective=t) for t in (*TOPICS[:6], "KABOOM", *TOPICS[6:])]
            responses = await asyncio.gather(*(client.post("/evaluate", json=t) for t in traces))
            reasons = [r.json()["novelty"]["reason"] for r in responses]
            assert reasons.count("embedding_failed") == 1
            assert reasons[6] == "embedding_failed"
            assert (await client.get("/cache")).json()["size"] == len(TOPICS)

    run(scenario)


def test_a_full_queue_turns_requests_away_at_once_and_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past KP_EMBED_QUEUE_LIMIT texts a request gets 503 with Retry-After at once, and nothing
    of it is added; the requests already queued are served."""
    traces = [make_trace(objective=f"{topic} (queued)") for topic in TOPICS[:6]]

    async def scenario() -> None:
        async with served(embedder_preload=True, embed_queue_limit=2) as (client, app):
            embeddings = app.state.service.runtime.embeddings
            gate = hold_runs(monkeypatch, embeddings)
            queued = [asyncio.create_task(client.post("/evaluate", json=t)) for t in traces[:2]]
            await until(lambda: embeddings.scheduler.queue_depth == 2)
            turned_away = [await client.post("/evaluate", json=t) for t in traces[2:]]
            gate.set()
            answered = await asyncio.gather(*queued)
            assert [r.status_code for r in answered] == [200, 200]
            for r in turned_away:
                assert r.status_code == 503
                assert r.headers["retry-after"] == "1"
                assert "KP_EMBED_QUEUE_LIMIT" in r.json()["detail"]
            assert (await client.get("/cache")).json()["size"] == 2
            metrics = (await client.get("/metrics")).text
            assert 'kp_overloaded_total{reason="queue_limit"} 4.0' in metrics
            # Once the queue has drained, the same traces are scored as usual.
            assert (await client.post("/evaluate", json=traces[2])).status_code == 200

    run(scenario)


@pytest.mark.server
@pytest.mark.slow
def test_a_burst_of_64_and_16_clients_in_a_closed_loop_are_all_served() -> None:
    """With the default limits, a burst and a closed loop are load a machine carries, even a
    slow one: every answer is 200, none is turned away."""
    burst = [make_trace(objective=f"{TOPICS[i % len(TOPICS)]} (burst {i})") for i in range(64)]

    async def scenario(url: str) -> None:
        # Idle connections are dropped by the client well before the server's keep-alive
        # timeout, so a busy machine's late close cannot meet a request already sent on them.
        limits = httpx.Limits(max_connections=64, keepalive_expiry=1.0)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
            answers = await asyncio.gather(*(client.post("/evaluate", json=t) for t in burst))
            assert [r.status_code for r in answers] == [200] * 64

            async def closed_loop_client(n: int) -> list[int]:
                statuses = []
                for i in range(6):
                    trace = make_trace(objective=f"{TOPICS[(n + i) % len(TOPICS)]} ({n}, {i})")
                    statuses.append((await client.post("/evaluate", json=trace)).status_code)
                return statuses

            loops = await asyncio.gather(*(closed_loop_client(n) for n in range(16)))
            assert [s for statuses in loops for s in statuses] == [200] * 96
            assert (await client.get("/readyz")).json()["cache_size"] == 64 + 96

    with running_server(embedder="onnx", embedder_preload="true") as server:
        asyncio.run(scenario(server.url))


def test_runs_side_by_side_give_the_vectors_of_runs_alone() -> None:
    """With two workers a burst runs on one-core sessions; novelty equals one-at-a-time runs."""
    known = [make_trace(objective=topic) for topic in TOPICS]
    probes = [make_trace(objective=f"How would you {topic.lower()}?") for topic in TOPICS]

    async def scenario() -> None:
        async with served(embedder_preload=True, embedder_workers=2) as (client, app):
            for trace in known:
                assert (await client.post("/evaluate", json=trace)).status_code == 200
            dry = {"dry_run": "true"}
            burst = await asyncio.gather(
                *(client.post("/evaluate", json=t, params=dry) for t in probes)
            )
            alone = [await client.post("/evaluate", json=t, params=dry) for t in probes]
            embeddings = app.state.service.runtime.embeddings
            assert embeddings.scheduler.workers == 2
            assert embeddings.scheduler.runs_total["one_core"] > 0  # the burst did run side by side
            for a, b in zip(burst, alone, strict=True):
                assert a.json()["novelty"]["measured"]
                assert a.json()["novelty"]["max_cosine"] == b.json()["novelty"]["max_cosine"]
                assert a.json()["score"] == b.json()["score"]

    run(scenario)


def test_a_request_that_waited_past_the_limit_is_turned_away_when_its_turn_comes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No request starts its model run more than KP_EMBED_MAX_WAIT_MS after it was queued."""

    async def scenario() -> None:
        service = real_embeddings(batch_size=1, max_wait_ms=50)
        await service.load()
        gate = hold_runs(monkeypatch, service)
        running = asyncio.create_task(service.embed(["the run in progress"]))
        await until(lambda: not service.scheduler.idle_workers)
        behind = [asyncio.create_task(service.embed([f"queued {i}"])) for i in range(3)]
        await asyncio.sleep(0.1)  # twice the limit: asyncio.sleep never returns early
        gate.set()
        outcomes = await asyncio.gather(*behind, return_exceptions=True)
        assert isinstance(await running, list)
        for outcome in outcomes:
            assert isinstance(outcome, OverloadedError)
            assert outcome.reason == "waited_too_long"
            assert "KP_EMBED_MAX_WAIT_MS" in str(outcome)
        assert service.scheduler.queue_depth == 0
        await service.close()

    run(scenario)


def test_a_worker_is_free_again_when_its_answer_reaches_the_client() -> None:
    """A client that sends its next request as soon as it has its answer must find the worker
    free (no stale count at the door, no 503). The exact order inside the scheduler is checked
    in test_embedding_parts.py."""
    seen: list[tuple[int, int]] = []

    async def scenario() -> None:
        service = real_embeddings(workers=2)
        await service.load()
        for topic in TOPICS:
            await service.embed([topic])
            seen.append((service.scheduler.queue_depth, service.scheduler.idle_workers))
        await service.close()

    run(scenario)
    assert seen == [(0, 2)] * len(TOPICS)


def test_closing_fails_the_requests_still_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        service = real_embeddings(batch_size=1)
        await service.load()
        gate = hold_runs(monkeypatch, service)
        requests = [asyncio.create_task(service.embed([f"request {i}"])) for i in range(4)]
        # The first is in its run (held there), the other three wait behind it.
        await until(
            lambda: service.scheduler.queue_depth == 4 and not service.scheduler.idle_workers
        )
        closing = asyncio.create_task(service.close())
        await until(lambda: service.scheduler.queue_depth == 1)
        gate.set()
        await closing
        outcomes = await asyncio.gather(*requests, return_exceptions=True)
        assert isinstance(outcomes[0], list), "the run in progress finishes"
        assert all(isinstance(o, EmbedderUnavailableError) for o in outcomes[1:])
        assert service.scheduler.queue_depth == 0
        with pytest.raises(EmbedderUnavailableError, match="shutting down"):
            await service.embed(["too late"])

    run(scenario)


def test_a_preloaded_service_is_warmed_up_before_it_reports_ready() -> None:
    """Preloading ends with runs through the queue and the workers, so the first request is
    not the first to take that path."""

    async def scenario() -> None:
        service = real_embeddings(workers=2)
        await service.preload()
        assert service.state is EmbedderState.READY
        assert service.scheduler.runs_total == {"all_cores": 3, "one_core": 0}
        assert service.loaded_fully
        assert service.scheduler.queue_depth == 0
        assert service.scheduler.idle_workers == 2
        await service.close()

    run(scenario)


@pytest.mark.slow
def test_a_lazy_load_answers_first_and_warms_up_after() -> None:
    """Without preload, the first request waits for the least it needs (the main session);
    the one-core session and the warm-up runs come after its answer."""

    async def scenario() -> None:
        service = real_embeddings(workers=2)
        (first,) = await service.embed(["the first trace after a start"])
        assert first.vector.shape == (384,)
        assert service.scheduler.runs_total == {"all_cores": 1, "one_core": 0}
        assert not service.loaded_fully
        await service.preload()  # waits for the warm-up that the first answer set off
        assert service.scheduler.runs_total == {"all_cores": 4, "one_core": 0}
        assert service.loaded_fully
        (again,) = await service.embed(["the first trace after a start"])
        assert np.array_equal(again.vector, first.vector)
        await service.close()

    run(scenario)


@pytest.mark.parametrize("preload", [True, False])
def test_a_model_that_cannot_embed_at_warm_up_leaves_the_embedder_unavailable(
    monkeypatch: pytest.MonkeyPatch, preload: bool
) -> None:
    async def scenario() -> None:
        service = real_embeddings()
        fail_embedding_on(monkeypatch, service, "warm up")
        if preload:
            await service.preload()
        else:
            await service.embed(["a request that arrives while the model loads"])
            await service.preload()  # the warm-up after the first answer
        assert service.state is EmbedderState.UNAVAILABLE
        assert "warm-up run failed" in (service.reason or "")
        assert service.degraded
        with pytest.raises(EmbedderUnavailableError, match="warm-up run failed"):
            await service.embed(["a later request"])
        await service.close()

    run(scenario)
