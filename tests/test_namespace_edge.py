"""Namespaces at the edge, without a server: the name's rule, the key file's `namespace`, and the
request pipeline resolving KP-Namespace (a bad name 422, a bound key naming another 403, both
before a byte of the body is read), the metrics' bounded label."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.types import ASGIApp

from app.core import namespaces
from app.core.config import Settings
from app.core.errors import ServiceError
from app.core.metrics import OTHER_NAMESPACES, Metrics
from app.guards.api_keys import ApiKey, KeyFileError, KeyRing, load_key_file
from app.guards.idempotency import scoped_key
from app.main import pipeline
from app.memory.base import DEFAULT_NAMESPACE
from tests.keys import AGENT_A, AGENT_B, entry, sha256, write_keys
from tests.test_pipeline import service_over

BOUND = "kp-bound-to-net-a-93be1c"
KEYS = KeyRing(
    [
        ApiKey(name="agent-a", sha256=sha256(AGENT_A), scopes=["evaluate"]),
        ApiKey(name="net-a", sha256=sha256(BOUND), scopes=["evaluate"], namespace="net-a"),
    ]
)


@pytest.mark.parametrize("name", ["default", "a", "net-a.v2_b", "A" * 64, "0", "..", "-"])
def test_names_that_follow_the_rule(name: str) -> None:
    assert namespaces.resolve(name, key_name=None, bound=None) == name


@pytest.mark.parametrize(
    "name", ["", "A" * 65, "net a", "{net}", "net:a", "net/a", "né", "net\na", "a*", "(other)"]
)
def test_names_that_break_the_rule_are_422_naming_the_header(name: str) -> None:
    with pytest.raises(ServiceError) as refused:
        namespaces.resolve(name, key_name=None, bound=None)
    assert refused.value.status == 422
    assert refused.value.kind == "namespace_invalid"
    assert str(refused.value) == (
        "KP-Namespace must be 1 to 64 characters of letters, digits, '.', '_' and '-'"
    )


def test_the_default_is_the_memory_s() -> None:
    assert namespaces.DEFAULT == DEFAULT_NAMESPACE


def test_without_a_header_the_key_s_namespace_else_default() -> None:
    assert namespaces.resolve(None, key_name=None, bound=None) == "default"
    assert namespaces.resolve(None, key_name="net-a", bound="net-a") == "net-a"
    assert namespaces.resolve("net-a", key_name="net-a", bound="net-a") == "net-a"
    with pytest.raises(ServiceError) as refused:
        namespaces.resolve("net-b", key_name="net-a", bound="net-a")
    assert refused.value.status == 403
    assert refused.value.kind == "namespace_forbidden"
    assert "bound to the namespace 'net-a'" in str(refused.value)
    assert "'net-b' refused" in str(refused.value)


def test_the_key_file_binds_a_key_to_a_namespace(tmp_path: Path) -> None:
    bound = {**entry("net-a", AGENT_A, ["evaluate"]), "namespace": "net-a"}
    free = entry("ops", AGENT_B, ["admin"])
    ring = KeyRing(load_key_file(write_keys(tmp_path / "keys.json", [bound, free])))
    found = ring.identify(AGENT_A)
    assert found is not None
    assert found.namespace == "net-a"
    other = ring.identify(AGENT_B)
    assert other is not None
    assert other.namespace is None


def test_a_bad_namespace_in_the_key_file_names_the_entry(tmp_path: Path) -> None:
    bad = {**entry("net-a", AGENT_A, ["evaluate"]), "namespace": "net{a}"}
    with pytest.raises(KeyFileError) as refused:
        load_key_file(write_keys(tmp_path / "keys.json", [bad]))
    assert str(refused.value).startswith("keys[0] ('net-a').namespace: String should match")


def test_idempotency_keys_are_scoped_per_namespace() -> None:
    assert scoped_key("agent-a", "net-a", "k1") != scoped_key("agent-a", "net-b", "k1")
    assert scoped_key(None, "default", "k1") == scoped_key(None, "default", "k1")


def test_the_namespace_label_is_bounded() -> None:
    metrics = Metrics(namespace_labels=2)
    assert metrics.namespace_label("a") == "a"
    assert metrics.namespace_label("b") == "b"
    assert metrics.namespace_label("c") == OTHER_NAMESPACES
    assert metrics.namespace_label("a") == "a"
    with pytest.raises(ServiceError):  # OTHER_NAMESPACES can never be a namespace's name
        namespaces.resolve(OTHER_NAMESPACES, key_name=None, bound=None)


# The pipeline, with a scripted client (as tests/test_pipeline.py).


class Client:
    def __init__(self, body: bytes) -> None:
        self.parts = [body[: len(body) // 2], body[len(body) // 2 :]]
        self.events: list[str] = []
        self.answer: dict[str, Any] | None = None

    async def receive(self) -> dict[str, Any]:
        if not self.parts:
            return {"type": "http.disconnect"}
        part = self.parts.pop(0)
        self.events.append("read")
        return {"type": "http.request", "body": part, "more_body": bool(self.parts)}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.events.append(f"answer {message['status']}")
        elif message["type"] == "http.response.body" and message.get("body"):
            self.answer = json.loads(message["body"])


def guarded(path: str = "/evaluate") -> tuple[ASGIApp, list[str]]:
    reached: list[str] = []

    async def route(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        reached.append(scope["state"]["caller"].namespace)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    settings = Settings(api_keys_file=Path(__file__))
    app = SimpleNamespace(state=SimpleNamespace(service=service_over(settings, KEYS)))
    inner: ASGIApp = route
    for cls, args, kwargs in reversed(pipeline(settings, Metrics())):
        inner = cls(inner, *args, **kwargs)

    async def with_app(scope: Any, receive: Any, send: Any) -> None:
        await inner({**scope, "app": app, "path": path}, receive, send)

    return with_app, reached


BODY = json.dumps({"trace": "x" * 1000}).encode()


def post(
    key: str, namespace: list[str] | None, path: str = "/evaluate"
) -> tuple[Client, list[str]]:
    app, reached = guarded(path)
    headers = [(b"content-type", b"application/json"), (b"authorization", f"Bearer {key}".encode())]
    headers += [(b"kp-namespace", n.encode()) for n in namespace or []]
    client = Client(BODY)
    scope = {"type": "http", "method": "POST", "query_string": b"", "headers": headers}
    asyncio.run(app(scope, client.receive, client.send))
    return client, reached


def test_the_route_gets_the_header_s_namespace() -> None:
    assert post(AGENT_A, ["net-b"])[1] == ["net-b"]
    assert post(AGENT_A, None)[1] == ["default"]
    assert post(BOUND, None)[1] == ["net-a"]
    assert post(BOUND, ["net-a"])[1] == ["net-a"]
    assert post(AGENT_A, ["net-b"], "/mcp")[1] == ["net-b"]


def test_a_bad_name_is_a_422_before_the_body_is_read() -> None:
    client, reached = post(AGENT_A, ["net{a}"])
    assert reached == []
    # Decided before the route read the body (the reads are the lingering close dropping it).
    assert client.events[-1] == "answer 422"
    assert client.answer == {
        "detail": [
            {
                "loc": ["header", "kp-namespace"],
                "msg": "KP-Namespace must be 1 to 64 characters of letters, digits, '.', '_' "
                "and '-'",
                "type": "namespace_invalid",
            }
        ]
    }


def test_a_bound_key_naming_another_namespace_is_a_403() -> None:
    client, reached = post(BOUND, ["net-b"])
    assert reached == []
    assert client.events[-1] == "answer 403"
    assert client.answer is not None
    (error,) = client.answer["detail"]
    assert error["loc"] == ["header", "kp-namespace"]
    assert error["type"] == "namespace_forbidden"
    assert "the API key 'net-a' is bound to the namespace 'net-a'" in error["msg"]


def test_two_namespace_headers_are_a_400() -> None:
    client, reached = post(AGENT_A, ["net-a", "net-b"])
    assert reached == []
    assert client.events[-1] == "answer 400"
    assert client.answer is not None
    assert client.answer["detail"][0]["type"] == "repeated_header"
