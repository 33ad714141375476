"""Idempotency-Key against live servers with the real model: a retry gets the first answer byte
for byte and adds nothing, on one replica and across two on one redis-server; another request
under the key is a 422; eight concurrent copies add one entry; keys are scoped per API key."""

from __future__ import annotations

import contextlib
import signal
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.factories import make_trace
from tests.keys import AGENT_A, AGENT_B, adds, bearer, keyed_env, standard_keys
from tests.server import LiveServer, RedisServer

pytestmark = [pytest.mark.server, pytest.mark.redis]


def post(
    server: LiveServer, body: Any, key: str | None, api_key: str = AGENT_A, **params: str
) -> httpx.Response:
    headers = {**bearer(api_key), "content-type": "application/json"}
    if key is not None:
        headers["Idempotency-Key"] = key
    return server.client.post(
        "/evaluate", content=orjson.dumps(body), headers=headers, params=params
    )


def fresh(tag: str) -> dict[str, Any]:
    """A trace whose text no other test uses: novel against everything cached."""
    return make_trace(
        trace_id=f"kp:trace:{tag}", objective=f"Idempotency check {tag} {uuid.uuid4()}"
    )


def env(keys: Path, **more: str) -> dict[str, str]:
    """Requests here may wait on one another's model runs for long on a busy machine."""
    return keyed_env(keys, KP_EMBED_MAX_WAIT_MS="60000", **more)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    directory = tmp_path_factory.mktemp("idem")
    server = LiveServer(env(standard_keys(directory / "keys.json")), directory / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def shared_env(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer
) -> dict[str, str]:
    directory = tmp_path_factory.mktemp("idem-shared")
    return env(
        standard_keys(directory / "keys.json"),
        KP_REDIS_URL=redis_server.url,
        KP_REDIS_PREFIX=f"kp-idem-{uuid.uuid4().hex[:8]}:",
        KP_REDIS_TIMEOUT_MS="10000",
    )


@pytest.fixture(scope="module")
def pair(
    tmp_path_factory: pytest.TempPathFactory, shared_env: dict[str, str]
) -> Iterator[tuple[LiveServer, LiveServer]]:
    directory = tmp_path_factory.mktemp("idem-pair")
    shared = shared_env
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(lambda i: LiveServer(shared, directory / f"replica-{i}.log"), range(2))
    yield a, b
    a.stop()
    b.stop()


def test_a_retry_gets_the_first_answer_byte_for_byte_and_adds_nothing(live: LiveServer) -> None:
    trace, key = fresh("retry"), uuid.uuid4().hex
    before = adds(live)
    first = post(live, trace, key)
    assert first.status_code == 200, first.text
    assert "idempotent-replayed" not in first.headers
    again = post(live, trace, key)
    assert again.status_code == 200
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert adds(live) == before + 1
    # Without the key the same trace is scored again and meets its own vector.
    plain = post(live, trace, None)
    assert plain.json()["novelty"]["max_cosine"] == pytest.approx(1.0, abs=1e-6)
    assert plain.content != first.content
    assert adds(live) == before + 2


def test_the_key_covers_the_body_and_the_query(live: LiveServer) -> None:
    trace, key = fresh("other-body"), uuid.uuid4().hex
    assert post(live, trace, key).status_code == 200
    before = adds(live)
    changed = {**trace, "id": "kp:trace:another"}
    for r in (post(live, changed, key), post(live, trace, key, dry_run="true")):
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["loc"] == ["header", "idempotency-key"]
        assert r.json()["detail"][0]["type"] == "idempotency_key_reused"
    assert adds(live) == before


def test_keys_are_scoped_to_the_api_key(live: LiveServer) -> None:
    key = uuid.uuid4().hex
    a = post(live, fresh("scope-a"), key, api_key=AGENT_A)
    b = post(live, fresh("scope-b"), key, api_key=AGENT_B)
    assert (a.status_code, b.status_code) == (200, 200)
    assert "idempotent-replayed" not in b.headers


@pytest.mark.parametrize(
    "value", ["k" * 256, '"' + "k" * 256 + '"', "has space", "tab\there", '""']
)
def test_a_malformed_key_is_a_400_and_changes_nothing(live: LiveServer, value: str) -> None:
    before = adds(live)
    r = post(live, fresh("bad-key"), value)
    assert r.status_code == 400, r.text
    assert r.json()["detail"][0]["loc"] == ["header", "idempotency-key"]
    assert "255" in r.json()["detail"][0]["msg"]
    assert adds(live) == before


def test_the_drafts_quoted_form_is_the_same_key(live: LiveServer) -> None:
    trace, key = fresh("quoted"), uuid.uuid4().hex
    first = post(live, trace, key)
    again = post(live, trace, f'"{key}"')
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content


def test_eight_concurrent_copies_add_one_entry(live: LiveServer) -> None:
    trace, key = fresh("eight"), uuid.uuid4().hex
    before = adds(live)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: post(live, trace, key), range(8)))
    ok = [r for r in answers if r.status_code == 200]
    assert all(r.status_code in (200, 409) for r in answers), [r.status_code for r in answers]
    assert ok
    assert len({r.content for r in ok}) == 1
    assert sum("idempotent-replayed" not in r.headers for r in ok) <= 1
    assert adds(live) == before + 1


def test_a_failed_first_request_does_not_hold_the_key(live: LiveServer) -> None:
    key = uuid.uuid4().hex
    invalid = {**fresh("invalid"), "steps": "none"}
    assert post(live, invalid, key).status_code == 422
    # The key was not used up by a 422: the corrected request under another key is the agent's
    # choice, and the same invalid request again is validated again, not replayed.
    again = post(live, invalid, key)
    assert again.status_code == 422
    assert "idempotent-replayed" not in again.headers


def test_across_two_replicas_the_retry_is_replayed(pair: tuple[LiveServer, LiveServer]) -> None:
    a, b = pair
    trace, key = fresh("replicas"), uuid.uuid4().hex
    before = adds(a)
    first = post(a, trace, key)
    assert first.status_code == 200, first.text
    again = post(b, trace, key)
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert post(b, {**trace, "id": "kp:trace:x"}, key).status_code == 422
    assert adds(a) == adds(b) == before + 1


def test_eight_copies_spread_over_two_replicas_add_one_entry(
    pair: tuple[LiveServer, LiveServer],
) -> None:
    a, b = pair
    trace, key = fresh("replicas-eight"), uuid.uuid4().hex
    before = adds(a)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: post((a, b)[i % 2], trace, key), range(8)))
    assert all(r.status_code in (200, 409) for r in answers), [r.status_code for r in answers]
    ok = [r for r in answers if r.status_code == 200]
    assert len({r.content for r in ok}) == 1
    assert adds(a) == before + 1


def test_a_claim_whose_holder_is_gone_frees_the_key_after_a_redis_crash(
    tmp_path: Path,
) -> None:
    """The holder claimed the key, then Redis was killed (-9) and the holder's answer could
    not be recorded nor its claim freed: the claim comes back from the AOF, but as a lease
    that lapses within seconds, and a retry runs instead of waiting 30 s for a 409."""
    import asyncio

    import redis.asyncio as aioredis

    from app.guards.idempotency import Idempotency, IdempotencyUnavailableError
    from app.guards.idempotency_redis import RedisIdempotencyStore

    server = RedisServer(tmp_path)
    try:

        async def claim_then_crash() -> str:
            client = aioredis.Redis.from_url(server.url)
            holder = Idempotency(RedisIdempotencyStore(client, "kp-lease:"))
            assert (await holder.begin("k", "fp")).action == "run"
            server.stop(signal.SIGKILL)
            # The holder answers meanwhile; its record cannot be written, nor the claim freed.
            with contextlib.suppress(IdempotencyUnavailableError):
                await holder.finish("k", "fp", None)
            server.start()  # the claim is back from the AOF
            other = aioredis.Redis.from_url(server.url)  # the retry, on another replica
            retry = Idempotency(RedisIdempotencyStore(other, "kp-lease:"))
            decision = await retry.begin("k", "fp")
            await retry.finish("k", "fp", None)
            await client.aclose()
            await other.aclose()
            return decision.action

        assert asyncio.run(claim_then_crash()) == "run"
    finally:
        server.stop()


def test_a_retry_after_the_replica_holding_its_key_died_is_answered(
    shared_env: dict[str, str], pair: tuple[LiveServer, LiveServer], tmp_path: Path
) -> None:
    _, b = pair
    victim = LiveServer(shared_env, tmp_path / "victim.log")
    # A batch long enough that the victim is still embedding when it is killed.
    traces = [
        make_trace(
            trace_id=f"kp:trace:victim-{i}",
            objective=f"Crash check {i} {uuid.uuid4()} " + "many words of a long objective " * 40,
        )
        for i in range(16)
    ]
    body, key = orjson.dumps({"traces": traces}), uuid.uuid4().hex
    headers = {**bearer(AGENT_A), "content-type": "application/json", "Idempotency-Key": key}
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(victim.client.post, "/evaluate/batch", content=body, headers=headers)
        time.sleep(0.3)  # the victim has claimed the key and is embedding
        victim.stop(signal.SIGKILL)
        with contextlib.suppress(httpx.TransportError):
            first.result()
    retry = b.client.post("/evaluate/batch", content=body, headers=headers)
    assert retry.status_code == 200, retry.text
    assert [r["trace_id"] for r in retry.json()["results"]] == [t["id"] for t in traces]
