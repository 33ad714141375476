"""kp_scoring (the client) against a real uvicorn server: every method, sync and async, and the
error types."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from app.schemas.trace import ReasoningTrace
from kp_scoring import (
    AsyncKpScoringClient,
    KpScoringClient,
    KpScoringError,
    Overloaded,
    RateLimited,
    TryLater,
    Unauthorized,
    Unreachable,
    ValidationFailed,
)
from kp_scoring.models import CacheOut, EvaluationOut, ReadyOut
from tests.factories import make_trace, step
from tests.keys import SLOW
from tests.server import TOKEN, Server, free_port, running_server

WORKED_EXAMPLE = 0.57625  # docs/scoring.md's worked example, novelty fixed at 0.5


@pytest.fixture
def kp(server: Server) -> Iterator[KpScoringClient]:
    with KpScoringClient(server.url, admin_token=TOKEN) as client:
        yield client


def invalid_trace() -> dict[str, object]:
    trace = make_trace()
    trace["steps"][0]["type"] = "musing"
    del trace["outcome"]
    return trace


def test_evaluate_a_dict_scores_the_worked_example(kp: KpScoringClient) -> None:
    result = kp.evaluate(make_trace())
    assert isinstance(result, EvaluationOut)
    assert result.trace_id == "kp:trace:test-0001"
    assert result.score == pytest.approx(WORKED_EXAMPLE, abs=1e-12)
    assert result.dimensions.novelty == 0.5
    assert result.weights.profile == "default"
    assert result.overrides == ["low_tool_diversity"]
    assert not result.novelty.measured
    assert result.novelty.reason == "embedder_unavailable"


def test_evaluate_accepts_a_reasoning_trace_model(kp: KpScoringClient) -> None:
    trace = ReasoningTrace.model_validate(make_trace(trace_id="kp:trace:model"))
    result = kp.evaluate(trace, dry_run=True)
    assert result.trace_id == "kp:trace:model"
    assert result.score == pytest.approx(WORKED_EXAMPLE, abs=1e-12)


def test_evaluate_batch_keeps_the_order(kp: KpScoringClient) -> None:
    single = make_trace(trace_id="kp:trace:single", steps=[step(0, "thought", "hmm")])
    results = kp.evaluate_batch([make_trace(), ReasoningTrace.model_validate(single)], dry_run=True)
    assert [r.trace_id for r in results] == ["kp:trace:test-0001", "kp:trace:single"]
    assert results[1].score == pytest.approx(0.1)
    assert results[1].overrides == ["single_thought"]


def test_health_and_ready(kp: KpScoringClient) -> None:
    assert kp.health() is True
    ready = kp.ready()
    assert isinstance(ready, ReadyOut)
    assert (ready.status, ready.degraded, ready.admin_auth) == ("degraded", True, True)
    assert ready.embedder.state == "disabled"


def test_cache_stats_and_reset_with_the_token(kp: KpScoringClient) -> None:
    stats = kp.cache_stats()
    assert isinstance(stats, CacheOut)
    assert (stats.size, stats.capacity, stats.dimensions) == (0, 1000, 384)
    assert kp.cache_reset() == 0


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_cache_needs_the_right_token(server: Server, token: str | None) -> None:
    with KpScoringClient(server.url, admin_token=token) as kp:
        with pytest.raises(Unauthorized) as stats_error:
            kp.cache_stats()
        with pytest.raises(Unauthorized):
            kp.cache_reset()
    assert stats_error.value.status_code == 401
    assert "Bearer" in str(stats_error.value.detail)


def test_validation_failed_lists_the_field_paths(kp: KpScoringClient) -> None:
    with pytest.raises(ValidationFailed) as raised:
        kp.evaluate(invalid_trace())
    exc = raised.value
    assert exc.status_code == 422
    assert {e.path for e in exc.errors} == {"body.steps.0.type", "body.outcome"}
    assert "body.outcome: Field required" in str(exc)

    with pytest.raises(ValidationFailed) as raised:
        kp.evaluate_batch([make_trace(), invalid_trace()])
    assert "body.traces.1.outcome" in {e.path for e in raised.value.errors}


def test_an_unreachable_server() -> None:
    with KpScoringClient(f"http://127.0.0.1:{free_port()}", timeout=2) as kp:
        assert kp.health() is False
        with pytest.raises(Unreachable) as raised:
            kp.evaluate(make_trace())
    assert isinstance(raised.value, KpScoringError)
    assert raised.value.status_code is None
    assert "cannot reach kp-scoring" in str(raised.value)


def test_dry_run_leaves_the_cache_alone(onnx_server: Server) -> None:
    with KpScoringClient(onnx_server.url, admin_token=TOKEN) as kp:
        kp.cache_reset()
        first = kp.evaluate(make_trace(), dry_run=True)
        assert first.novelty.reason == "cache_empty"
        assert kp.cache_stats().size == 0
        kp.evaluate(make_trace())
        assert kp.cache_stats().size == 1
        again = kp.evaluate(make_trace(), dry_run=True)
        assert again.novelty.measured
        assert again.novelty.max_cosine == pytest.approx(1.0, abs=1e-3)
        assert again.score < first.score
        assert kp.cache_reset() == 1
        assert kp.cache_stats().size == 0


def test_errors_without_a_json_body_keep_the_status() -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(502, text="bad gateway"))
    with KpScoringClient(transport=transport) as kp, pytest.raises(KpScoringError) as raised:
        kp.ready()
    assert type(raised.value) is KpScoringError
    assert (raised.value.status_code, raised.value.detail) == (502, "bad gateway")


# --- async ---------------------------------------------------------------------------------


def test_async_client_every_method(server: Server) -> None:
    async def scenario() -> None:
        async with AsyncKpScoringClient(server.url, admin_token=TOKEN) as kp:
            one = await kp.evaluate(ReasoningTrace.model_validate(make_trace()))
            batch = await kp.evaluate_batch([make_trace(), make_trace(trace_id="kp:trace:b")])
            assert one.score == pytest.approx(WORKED_EXAMPLE, abs=1e-12)
            assert [r.trace_id for r in batch] == ["kp:trace:test-0001", "kp:trace:b"]
            assert await kp.health() is True
            assert (await kp.ready()).admin_auth is True
            assert (await kp.cache_stats()).capacity == 1000
            assert await kp.cache_reset() == 0

    asyncio.run(scenario())


def test_async_client_errors(server: Server) -> None:
    async def scenario() -> None:
        async with AsyncKpScoringClient(server.url) as kp:
            with pytest.raises(ValidationFailed) as raised:
                await kp.evaluate(invalid_trace(), dry_run=True)
            assert "body.steps.0.type" in {e.path for e in raised.value.errors}
            with pytest.raises(Unauthorized):
                await kp.cache_stats()
        async with AsyncKpScoringClient(f"http://127.0.0.1:{free_port()}") as kp:
            assert await kp.health() is False
            with pytest.raises(Unreachable):
                await kp.ready()

    asyncio.run(scenario())


@pytest.mark.server
def test_async_overloaded_carries_retry_after() -> None:
    """With room for one text in the queue, concurrent requests are turned away with 503."""

    def long_trace(n: int) -> dict[str, Any]:
        # Texts of their own: one text asked for at once is one model run (the vector memo).
        return make_trace(objective=" ".join(["overload"] * 600) + f" {n}")

    async def scenario(url: str) -> Overloaded:
        async with AsyncKpScoringClient(url, timeout=30) as kp:
            for round_ in range(20):  # bounded: the first round almost always overloads
                calls = [kp.evaluate(long_trace(round_ * 12 + i), dry_run=True) for i in range(12)]
                for outcome in await asyncio.gather(*calls, return_exceptions=True):
                    if isinstance(outcome, Overloaded):
                        return outcome
                    assert isinstance(outcome, EvaluationOut), outcome
        raise AssertionError("no request was turned away")

    with running_server(embedder="onnx", embed_queue_limit="1", embed_batch_size="1") as s:
        overloaded = asyncio.run(scenario(s.url))
    assert overloaded.status_code == 503
    assert overloaded.retry_after == 1.0
    assert "overloaded" in str(overloaded.detail)


# --- try later: 429 and 503 ------------------------------------------------------------------


def busy_then(server: Server, *answers: tuple[int, str | None]) -> httpx.MockTransport:
    """Answers (status, Retry-After) first, then forwards to the live server."""
    pending = list(answers)
    live = httpx.HTTPTransport()

    def handle(request: httpx.Request) -> httpx.Response:
        if pending:
            status, retry_after = pending.pop(0)
            headers = {} if retry_after is None else {"Retry-After": retry_after}
            return httpx.Response(status, json={"detail": "busy"}, headers=headers)
        request.url = request.url.copy_with(host="127.0.0.1", port=httpx.URL(server.url).port)
        return live.handle_request(request)

    return httpx.MockTransport(handle)


def test_retries_wait_the_retry_after_of_each_answer(server: Server) -> None:
    slept: list[float] = []
    transport = busy_then(server, (503, "2"), (429, None), (429, "0.5"))
    with KpScoringClient(
        "http://kp.invalid", retries=3, transport=transport, sleep=slept.append
    ) as kp:
        result = kp.evaluate(make_trace(), dry_run=True)
    assert result.score == pytest.approx(WORKED_EXAMPLE, abs=1e-12)
    assert slept == [2.0, 1.0, 0.5]  # 1 s where the answer gave no Retry-After


@pytest.mark.parametrize(
    ("retries", "answers", "slept"),
    [
        (0, [(503, "1")], []),  # the default: no retry
        (1, [(503, "1"), (429, "1")], [1.0]),  # retries spent
        (5, [(429, "31")], []),  # longer than max_retry_wait (30 s): not waited for
    ],
)
def test_try_later_is_raised_when_the_retries_end(
    server: Server, retries: int, answers: list[tuple[int, str]], slept: list[float]
) -> None:
    waited: list[float] = []
    transport = busy_then(server, *answers)
    with (
        KpScoringClient(
            "http://kp.invalid", retries=retries, transport=transport, sleep=waited.append
        ) as kp,
        pytest.raises(TryLater) as raised,
    ):
        kp.evaluate(make_trace(), dry_run=True)
    status, retry_after = answers[-1]
    assert type(raised.value) is (Overloaded if status == 503 else RateLimited)
    assert (raised.value.status_code, raised.value.retry_after) == (status, float(retry_after))
    assert waited == slept


def test_the_async_client_retries_too(server: Server) -> None:
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    async def scenario() -> EvaluationOut:
        transport = busy_then(server, (429, "0.25"))
        async with AsyncKpScoringClient(
            "http://kp.invalid", retries=1, transport=AsyncTransport(transport), sleep=sleep
        ) as kp:
            return await kp.evaluate(make_trace(), dry_run=True)

    assert asyncio.run(scenario()).score == pytest.approx(WORKED_EXAMPLE, abs=1e-12)
    assert slept == [0.25]


class AsyncTransport(httpx.AsyncBaseTransport):
    """A sync transport, for the async client (the forwarding above is blocking)."""

    def __init__(self, sync: httpx.MockTransport) -> None:
        self.sync = sync

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        response = self.sync.handle_request(request)
        response.read()
        return httpx.Response(
            response.status_code, headers=response.headers, content=response.content
        )


def test_a_live_rate_limit_is_try_later_with_its_retry_after(keyed: Server) -> None:
    with KpScoringClient(keyed.url, api_key=SLOW, retries=3, max_retry_wait=5) as kp:
        kp.evaluate(make_trace(), dry_run=True)
        with pytest.raises(RateLimited) as raised:  # one a minute: not waited for
            kp.evaluate(make_trace(), dry_run=True)
    assert raised.value.retry_after is not None
    assert 5 < raised.value.retry_after <= 60
    assert isinstance(raised.value, TryLater)
