"""The README's examples, run as they stand in the README."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.factories import make_trace
from tests.server import TOKEN, running_server

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.DOTALL)


def test_the_curl_example_answers_what_the_readme_shows(client: TestClient) -> None:
    (curl,) = [b for b in blocks("console") if "curl" in b]
    assert "-d @examples/trace.json" in curl
    trace = json.loads((ROOT / "examples" / "trace.json").read_text())
    shown = json.loads(blocks("json")[0])
    got = client.post("/evaluate", json=trace).json()
    assert {k: v for k, v in got.items() if k != "elapsed_ms"} == {
        k: v for k, v in shown.items() if k != "elapsed_ms"
    }
    again = client.post("/evaluate", json=trace).json()
    assert '"max_cosine": 1.0' in README
    assert again["novelty"]["max_cosine"] == pytest.approx(1.0, abs=1e-6)
    assert again["score"] == pytest.approx(0.40125, abs=1e-6)


def test_the_python_client_examples_run_as_written() -> None:
    sync_block, async_block = [b for b in blocks("python") if "app.client" in b]
    with running_server() as server:
        namespace = {"trace": make_trace(), "traces": [make_trace(), make_trace()]}
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            for block in (sync_block, async_block):
                code = block.replace("http://127.0.0.1:8000", server.url).replace("s3cret", TOKEN)
                exec(compile(code, "README.md", "exec"), namespace)
    assert out.getvalue().splitlines() == [
        "0.57625 default ['low_tool_diversity']",
        "2 degraded 0",
        "['body.@context', 'body.id', 'body.metadata']",
        "[0.57625, 0.57625]",
    ]


def test_every_setting_is_documented() -> None:
    from app.core.config import Settings

    for name in Settings.model_fields:
        assert f"`KP_{name.upper()}`" in README, name
