"""The embedding service's parts, each alone: no model, no server, no event loop where none is
needed. (The service with the real model is tests/test_concurrency.py.)"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, cast

import numpy as np
import pytest

from app.core.states import EmbedderState
from app.embedding.embeddings import EmbeddingService
from app.embedding.onnx_embedder import ModelError, OnnxEmbedder
from app.embedding.scheduler import RunScheduler
from app.embedding.types import (
    EmbedderUnavailableError,
    Embedding,
    Outcome,
    OverloadedError,
)


def fake_embedding(text: str) -> Embedding:
    """Stands in for the model's answer: the scheduler only routes answers, never reads them."""
    return Embedding(np.full(3, len(text), dtype=np.float32), len(text), False)


# ── scheduler ───────────────────────────────────────────────────────────────


class Recorder:
    def __init__(self) -> None:
        self.waits: list[float] = []
        self.runs: list[float] = []

    def queue_waited(self, seconds: float) -> None:
        self.waits.append(seconds)

    def model_ran(self, seconds: float) -> None:
        self.runs.append(seconds)


def settled(scheduler: RunScheduler, texts: list[str]) -> Outcome:
    """Submits and waits for the outcome (on a worker thread)."""
    done = threading.Event()
    box: list[Outcome] = []

    def settle(outcome: Outcome) -> None:
        box.append(outcome)
        done.set()

    scheduler.submit(texts, settle)
    assert done.wait(60), "the stop for a broken test, not a claim about speed"
    return box[0]


def test_each_request_gets_its_own_vectors_and_the_observer_hears_of_it() -> None:
    observer = Recorder()
    scheduler = RunScheduler(
        lambda texts, one_core: [fake_embedding(t) for t in texts], observer=observer
    )
    scheduler.start()
    outcome = settled(scheduler, ["ab", "abcd"])
    assert isinstance(outcome, list)
    assert [e.token_count for e in outcome] == [2, 4]
    assert len(observer.waits) == 1
    assert len(observer.runs) == 1
    assert observer.waits[0] >= 0
    assert observer.runs[0] >= 0
    assert scheduler.runs_total == {"all_cores": 1, "one_core": 0}
    scheduler.close()
    scheduler.join()


def test_a_worker_is_free_before_the_answer_is_handed_over() -> None:
    scheduler = RunScheduler(lambda texts, one_core: [fake_embedding(t) for t in texts], workers=2)
    scheduler.start()
    seen: list[tuple[int, int]] = []
    done = threading.Event()

    def settle(outcome: Outcome) -> None:
        seen.append((scheduler.queue_depth, scheduler.idle_workers))
        done.set()

    scheduler.submit(["text"], settle)
    assert done.wait(60)
    assert seen == [(0, 2)]
    scheduler.close()
    scheduler.join()


def test_a_failing_run_is_retried_one_request_at_a_time() -> None:
    gate = threading.Event()
    calls: list[list[str]] = []

    def backend(texts: list[str], one_core: bool) -> list[Embedding]:
        gate.wait()
        calls.append(texts)
        if "bad" in texts:
            raise RuntimeError("boom")
        return [fake_embedding(t) for t in texts]

    scheduler = RunScheduler(backend, batch_size=8)
    scheduler.start()
    outcomes: dict[str, Outcome] = {}
    all_done = threading.Event()

    def settle_as(name: str) -> Any:
        def settle(outcome: Outcome) -> None:
            outcomes[name] = outcome
            if len(outcomes) == 3:
                all_done.set()

        return settle

    scheduler.submit(["first"], settle_as("first"))  # held in its run by the gate
    while scheduler.idle_workers:
        threading.Event().wait(0.001)
    scheduler.submit(["good"], settle_as("good"))
    scheduler.submit(["bad"], settle_as("bad"))
    gate.set()
    assert all_done.wait(60)
    assert calls == [["first"], ["good", "bad"], ["good"], ["bad"]]
    assert isinstance(outcomes["good"], list)
    failure = outcomes["bad"]
    assert isinstance(failure, EmbedderUnavailableError)
    assert failure.code == "embedding_failed"
    scheduler.close()
    scheduler.join()


def test_closing_fails_what_waits_and_refuses_what_comes() -> None:
    scheduler = RunScheduler(lambda texts, one_core: [fake_embedding(t) for t in texts])
    outcomes: list[Outcome] = []
    scheduler.submit(["waiting"], outcomes.append)  # no worker started: it waits
    scheduler.close()
    assert len(outcomes) == 1
    assert isinstance(outcomes[0], EmbedderUnavailableError)
    assert scheduler.queue_depth == 0
    with pytest.raises(EmbedderUnavailableError, match="shutting down"):
        scheduler.submit(["late"], outcomes.append)
    assert not scheduler.start()


def test_the_door_refuses_what_would_pass_the_queue_limit() -> None:
    scheduler = RunScheduler(lambda texts, one_core: [], queue_limit=4)
    scheduler.submit(["a", "b"], lambda outcome: None)  # no worker: stays queued
    scheduler.submit(["c", "d"], lambda outcome: None)
    with pytest.raises(OverloadedError, match="KP_EMBED_QUEUE_LIMIT") as refused:
        scheduler.submit(["e"], lambda outcome: None)
    assert refused.value.reason == "queue_limit"
    assert scheduler.queue_depth == 4
    scheduler.close()


def test_a_request_larger_than_the_limit_is_taken_when_nothing_waits() -> None:
    scheduler = RunScheduler(lambda texts, one_core: [], queue_limit=4)
    scheduler.submit(["text"] * 100, lambda outcome: None)
    assert scheduler.queue_depth == 100
    scheduler.close()


def recording(calls: list[list[str]]) -> Any:
    def backend(texts: list[str], one_core: bool) -> list[Embedding]:
        calls.append(texts)
        return [fake_embedding(t) for t in texts]

    return backend


def settle_into(outcomes: dict[str, Outcome], name: str, count: int, done: threading.Event) -> Any:
    def settle(outcome: Outcome) -> None:
        outcomes[name] = outcome
        if len(outcomes) == count:
            done.set()

    return settle


def test_runs_follow_arrival_order_up_to_the_batch_size() -> None:
    calls: list[list[str]] = []
    scheduler = RunScheduler(recording(calls), batch_size=3)
    outcomes: dict[str, Outcome] = {}
    done = threading.Event()
    for texts in (["a", "b"], ["c"], ["d", "e"]):  # no worker yet: all three wait
        scheduler.submit(texts, settle_into(outcomes, texts[0], 3, done))
    scheduler.start()
    assert done.wait(60)
    assert calls == [["a", "b", "c"], ["d", "e"]]
    scheduler.close()
    scheduler.join()


def test_the_stale_head_of_the_queue_is_shed_up_to_the_first_fresh_job() -> None:
    calls: list[list[str]] = []
    scheduler = RunScheduler(recording(calls), max_wait_ms=60_000)
    outcomes: dict[str, Outcome] = {}
    done = threading.Event()
    jobs = {
        name: scheduler.submit([name], settle_into(outcomes, name, 3, done))
        for name in ("gone", "old", "fresh", "later")
    }
    jobs["gone"].abandoned = lambda: True  # nobody awaits it: dropped, not answered
    jobs["old"].queued_at -= 61
    jobs["later"].queued_at -= 61  # behind a fresh job: runs with it
    scheduler.start()
    assert done.wait(60)
    assert calls == [["fresh", "later"]]
    assert set(outcomes) == {"old", "fresh", "later"}
    error = outcomes["old"]
    assert isinstance(error, OverloadedError)
    assert error.reason == "waited_too_long"
    assert "KP_EMBED_MAX_WAIT_MS" in str(error)
    scheduler.close()
    scheduler.join()


# ── load and warm-up ────────────────────────────────────────────────────────


class StandIn:
    """What the service calls on an embedder, without the model."""

    def __init__(self, fails: bool = False) -> None:
        self.finished = 0
        self.fails = fails
        self.cache_outcome = None  # how the session came to be (app.embedding.session_cache)

    def finish_loading(self) -> None:
        self.finished += 1

    def embed_grouped(self, texts: list[str], **_: Any) -> list[Embedding]:
        if self.fails:
            raise RuntimeError("the model cannot run")
        return [fake_embedding(t) for t in texts]


def test_no_factory_means_disabled() -> None:
    service = EmbeddingService(None, model_name=None)
    assert service.state is EmbedderState.DISABLED
    asyncio.run(service.load())
    assert service.state is EmbedderState.DISABLED
    assert service.reason is not None


def test_concurrent_loads_share_one_load_and_warm_up_finishes_the_model() -> None:
    made: list[StandIn] = []

    def factory() -> OnnxEmbedder:
        made.append(StandIn())
        return cast(OnnxEmbedder, made[-1])

    async def scenario() -> None:
        service = EmbeddingService(factory, model_name=None)
        assert service.state is EmbedderState.NOT_LOADED
        await asyncio.gather(service.load(), service.load(), service.load())
        assert service.state is EmbedderState.READY
        assert len(made) == 1
        assert not service.loaded_fully
        await service.warm_up()
        assert service.loaded_fully
        assert made[0].finished == 1
        assert service.scheduler.runs_total == {"all_cores": 3, "one_core": 0}  # the warm-up's runs
        await service.close()

    asyncio.run(scenario())


def test_a_model_that_cannot_load_leaves_the_embedder_unavailable() -> None:
    def factory() -> OnnxEmbedder:
        raise ModelError("model.onnx: not an ONNX file")

    service = EmbeddingService(factory, model_name=None)
    asyncio.run(service.load())
    assert service.state is EmbedderState.UNAVAILABLE
    assert service.reason == "model.onnx: not an ONNX file"


def test_a_failing_warm_up_run_leaves_the_embedder_unavailable() -> None:
    async def scenario() -> None:
        service = EmbeddingService(lambda: cast(OnnxEmbedder, StandIn(fails=True)), model_name=None)
        await service.load()
        await service.warm_up()
        assert service.state is EmbedderState.UNAVAILABLE
        assert "warm-up run failed" in (service.reason or "")
        await service.close()

    asyncio.run(scenario())
