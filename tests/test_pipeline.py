"""The request pipeline's order, with a scripted client: keys and limits answer before a byte
of the body is read; the body's limits before the route."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from starlette.types import ASGIApp

from app.core.config import Settings
from app.core.metrics import Metrics
from app.guards.api_keys import ApiKey, KeyRing
from app.guards.idempotency import Idempotency, InProcessIdempotencyStore
from app.guards.rate_limit import InProcessRateLimiter
from app.main import pipeline
from app.service.scoring_service import ScoringService
from tests.keys import AGENT_A, SLOW, sha256

KEYS = KeyRing(
    [
        ApiKey(name="agent-a", sha256=sha256(AGENT_A), scopes=["evaluate"]),
        ApiKey(name="slow", sha256=sha256(SLOW), scopes=["evaluate"], rate_per_minute=1),
    ]
)


class Client:
    """Sends a body in chunks and records when each was read, relative to the answer."""

    def __init__(self, body: bytes, chunks: int = 4) -> None:
        size = -(-len(body) // chunks)
        self.parts = [body[i : i + size] for i in range(0, len(body), size)]
        self.events: list[str] = []

    async def receive(self) -> dict[str, Any]:
        if not self.parts:
            return {"type": "http.disconnect"}
        part = self.parts.pop(0)
        self.events.append("read")
        return {"type": "http.request", "body": part, "more_body": bool(self.parts)}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.events.append(f"answer {message['status']}")


def service_over(settings: Settings, keys: KeyRing) -> Any:
    """The service with `keys`, over in-process guards and no model or memory: what the
    pipeline asks of it before a route runs."""
    runtime: Any = SimpleNamespace(
        rate_limiter=InProcessRateLimiter(), idempotency=Idempotency(InProcessIdempotencyStore())
    )
    return ScoringService(settings, runtime, Metrics(), keys, None)


def guarded() -> tuple[ASGIApp, list[bytes]]:
    reached: list[bytes] = []

    async def route(scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        reached.append(message["body"])
        payload = b'{"ok": true}'
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": payload, "more_body": False})

    # Keys required (any existing file: the pipeline is handed KEYS itself).
    settings = Settings(api_keys_file=Path(__file__), max_body_bytes=4096, max_json_depth=8)
    app = SimpleNamespace(state=SimpleNamespace(service=service_over(settings, KEYS)))
    inner: ASGIApp = route
    # As Starlette builds its stack: the first middleware outermost.
    for cls, args, kwargs in reversed(pipeline(settings, Metrics())):
        inner = cls(inner, *args, **kwargs)

    async def with_app(scope: Any, receive: Any, send: Any) -> None:
        await inner({**scope, "app": app}, receive, send)

    return with_app, reached


def post(app: ASGIApp, client: Client, headers: dict[str, str]) -> None:
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/evaluate",
        "query_string": b"",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }
    asyncio.run(app(scope, client.receive, client.send))


BODY = json.dumps({"trace": "x" * 1000}).encode()
JSON = {"content-type": "application/json", "content-length": str(len(BODY))}


def test_a_missing_key_is_answered_before_the_body_is_read() -> None:
    app, reached = guarded()
    client = Client(BODY)
    post(app, client, JSON)
    # Not read by the pipeline: the reads are the lingering close dropping the body before
    # the answer goes out.
    assert client.events == ["read", "read", "read", "read", "answer 401"]
    assert reached == []


def test_a_key_over_its_rate_is_answered_before_the_body_is_read() -> None:
    app, reached = guarded()
    first = Client(BODY)
    post(app, first, {**JSON, "authorization": f"Bearer {SLOW}"})
    assert first.events[-1] == "answer 200"
    second = Client(BODY)
    post(app, second, {**JSON, "authorization": f"Bearer {SLOW}"})
    assert second.events == ["read", "read", "read", "read", "answer 429"]
    assert reached == [BODY]


def test_the_body_limits_come_before_the_route() -> None:
    app, reached = guarded()
    deep = Client(b"[" * 20 + b"]" * 20)
    post(app, deep, {"content-type": "application/json", "authorization": f"Bearer {AGENT_A}"})
    assert deep.events[-1] == "answer 422"
    large = Client(b"x" * 5000)
    post(app, large, {"content-type": "application/json", "authorization": f"Bearer {AGENT_A}"})
    assert "answer 413" in large.events
    assert reached == []
