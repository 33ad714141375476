"""The README's examples, run as they stand in the README."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.factories import make_trace
from tests.server import TOKEN, running_server

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.DOTALL)


def _same(got: Any, shown: Any) -> bool:
    """Equal, floats within 1e-12: the README shows this machine's last bits of a float64,
    another CPU's may differ there (README says so), any real change is far larger."""
    if isinstance(shown, float) and isinstance(got, float):
        return math.isclose(got, shown, rel_tol=0, abs_tol=1e-12)
    if isinstance(shown, dict) and isinstance(got, dict):
        return got.keys() == shown.keys() and all(_same(got[k], shown[k]) for k in shown)
    if isinstance(shown, list) and isinstance(got, list):
        return len(got) == len(shown) and all(map(_same, got, shown))
    return bool(got == shown) and type(got) is type(shown)


def test_the_curl_example_and_its_repeat_answer_what_the_readme_shows(
    client: TestClient,
) -> None:
    (curl,) = [b for b in blocks("console") if "curl" in b]
    assert "-d @examples/trace.json" in curl
    trace = json.loads((ROOT / "examples" / "trace.json").read_text())
    first_shown, again_shown = (json.loads(b) for b in blocks("json")[:2])
    for shown in (first_shown, again_shown):
        got = client.post("/evaluate", json=trace).json()
        got["elapsed_ms"] = shown["elapsed_ms"]  # a time, not a result
        if got["novelty"]["nearest"] is not None:  # so is the nearest trace's age
            got["novelty"]["nearest"]["age_ms"] = shown["novelty"]["nearest"]["age_ms"]
        assert _same(got, shown), (got, shown)
    assert again_shown["novelty"]["measured"] is True


@pytest.mark.server
def test_the_python_client_examples_run_as_written() -> None:
    # The client's package is kp_scoring (clients/python); README's blocks may still say app.client.
    sync_block, async_block = [
        b.replace("from app.client import", "from kp_scoring import")
        for b in blocks("python")
        if "app.client" in b or "kp_scoring" in b
    ]
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
