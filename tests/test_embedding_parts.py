"""The embedding service's parts, each alone: no model, no server, no event loop where none is
needed. (The service with the real model is tests/test_concurrency.py.)"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, cast

import numpy as np
import pytest

from app.core.states import EmbedderState
from app.embedding.embeddings import ModelLifecycle
from app.embedding.onnx_embedder import ModelError, OnnxEmbedder
from app.embedding.scheduler import Job, JobQueue, QueueLimits, RunScheduler
from app.embedding.types import (
    EmbedderUnavailableError,
    Embedding,
    Outcome,
    OverloadedError,
)


def job(*texts: str, queued_at: float | None = None) -> Job:
    made = Job(texts, lambda outcome: None)
    if queued_at is not None:
        made.queued_at = queued_at
    return made


def fake_embedding(text: str) -> Embedding:
    """Stands in for the model's answer: the scheduler only routes answers, never reads them."""
    return Embedding(np.full(3, len(text), dtype=np.float32), len(text), False)


# ── admission ───────────────────────────────────────────────────────────────


def test_the_door_refuses_what_would_pass_the_queue_limit() -> None:
    door = QueueLimits(queue_limit=4, max_wait_ms=1000)
    door.check_door(queued=2, count=2)
    with pytest.raises(OverloadedError, match="KP_EMBED_QUEUE_LIMIT") as refused:
        door.check_door(queued=3, count=2)
    assert refused.value.reason == "queue_limit"


def test_a_request_larger_than_the_limit_is_taken_when_nothing_waits() -> None:
    QueueLimits(queue_limit=4).check_door(queued=0, count=100)


def test_a_request_expires_only_past_the_max_wait() -> None:
    door = QueueLimits(max_wait_ms=50)
    assert door.expired(0.05) is None
    error = door.expired(0.051)
    assert error is not None
    assert error.reason == "waited_too_long"
    assert "KP_EMBED_MAX_WAIT_MS" in str(error)


# ── queue ───────────────────────────────────────────────────────────────────


def test_take_follows_arrival_order_up_to_the_text_limit() -> None:
    queue = JobQueue()
    jobs = [job("a", "b"), job("c"), job("d", "e")]
    for j in jobs:
        queue.put(j)
    assert queue.texts == 5
    assert queue.take(3) == jobs[:2]
    assert queue.texts == 2
    assert len(queue) == 1


def test_pop_stale_stops_at_the_first_fresh_job() -> None:
    queue = JobQueue()
    old, fresh, old_again = job("a", queued_at=0.0), job("b"), job("c", queued_at=0.0)
    for j in (old, fresh, old_again):
        queue.put(j)
    assert queue.pop_stale(lambda j: j.queued_at == 0.0) == [old]
    assert len(queue) == 2


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


def test_the_door_counts_what_waits() -> None:
    scheduler = RunScheduler(
        lambda texts, one_core: [], limits=QueueLimits(queue_limit=2, max_wait_ms=1000)
    )
    scheduler.submit(["a", "b"], lambda outcome: None)  # no worker: stays queued
    with pytest.raises(OverloadedError):
        scheduler.submit(["c"], lambda outcome: None)
    scheduler.close()


# ── lifecycle ───────────────────────────────────────────────────────────────


class StandIn:
    """What the lifecycle calls on an embedder (the model itself is not its business)."""

    def __init__(self) -> None:
        self.finished = 0
        self.cache_outcome = None  # how the session came to be (app.embedding.session_cache)

    def finish_loading(self) -> None:
        self.finished += 1


def lifecycle(factory: Any, warm_runs: Any = None) -> ModelLifecycle:
    async def no_runs() -> None:
        pass

    return ModelLifecycle(factory, on_loaded=lambda: True, warm_runs=warm_runs or no_runs)


def test_no_factory_means_disabled() -> None:
    life = lifecycle(None)
    assert life.state is EmbedderState.DISABLED
    asyncio.run(life.load())
    assert life.state is EmbedderState.DISABLED
    assert life.reason is not None


def test_concurrent_loads_share_one_load_and_warm_up_finishes_the_model() -> None:
    made: list[StandIn] = []

    def factory() -> OnnxEmbedder:
        made.append(StandIn())
        return cast(OnnxEmbedder, made[-1])

    async def scenario() -> None:
        life = lifecycle(factory)
        assert life.state is EmbedderState.NOT_LOADED
        await asyncio.gather(life.load(), life.load(), life.load())
        assert life.state is EmbedderState.READY
        assert len(made) == 1
        assert not life.warmed_up
        await life.warm_up()
        assert life.warmed_up
        assert made[0].finished == 1

    asyncio.run(scenario())


def test_a_model_that_cannot_load_leaves_the_embedder_unavailable() -> None:
    def factory() -> OnnxEmbedder:
        raise ModelError("model.onnx: not an ONNX file")

    life = lifecycle(factory)
    asyncio.run(life.load())
    assert life.state is EmbedderState.UNAVAILABLE
    assert life.reason == "model.onnx: not an ONNX file"


def test_a_failing_warm_up_run_leaves_the_embedder_unavailable() -> None:
    async def failing_runs() -> None:
        raise EmbedderUnavailableError("embedding failed: RuntimeError", "embedding_failed")

    async def scenario() -> None:
        life = lifecycle(lambda: cast(OnnxEmbedder, StandIn()), failing_runs)
        await life.load()
        await life.warm_up()
        assert life.state is EmbedderState.UNAVAILABLE
        assert "warm-up run failed" in (life.reason or "")

    asyncio.run(scenario())
