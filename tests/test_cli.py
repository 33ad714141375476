"""The kp-scoring CLI against a real server: typer's runner, and the installed script."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pty
import re
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner, Result

from kp_scoring import KpScoringClient
from kp_scoring import cli as cli_module
from kp_scoring.cli import cli
from kp_scoring.models import EvaluationOut, NoveltyOut
from tests.factories import make_trace, step
from tests.keys import SLOW
from tests.server import TOKEN, Server, entry_point, free_port, running_server

# The caller's terminal settings do not reach the command (its output is not a terminal, so
# it is plain and unwrapped whatever COLUMNS says); KP_* come from each test.
PLAIN = {"FORCE_COLOR": None, "TTY_COMPATIBLE": None, "NO_COLOR": None, "COLUMNS": None}
PLAIN |= {"KP_URL": None, "KP_ADMIN_TOKEN": None}

BREAKDOWN = """\
kp:trace:test-0001  score 0.5763  below (threshold 0.75)  weights: default
dimension           value  weight  weighted
complexity          0.405  0.25    0.101
novelty             0.500  0.35    0.175
tool_diversity      1.000  0.15    0.150
outcome_confidence  1.000  0.25    0.250
weighted sum                       0.676
overrides: low_tool_diversity (tools used, but at most one distinct tool: -0.1)
novelty: not measured (embedder_unavailable: disabled by KP_EMBEDDER=none)
"""


def run(args: list[str], url: str, *, stdin: str | None = None, **env: str) -> Result:
    return CliRunner().invoke(cli, args, input=stdin, env={**PLAIN, "KP_URL": url, **env})


def write(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def passing_trace(trace_id: str = "kp:trace:pass") -> dict[str, Any]:
    """Scores 0.87107 with no embedder: two tools and the error-recovery bonus."""
    steps = [
        step(0, "thought", "plan"),
        step(1, "tool_call", "look", tool="search"),
        step(2, "tool_call", "read", tool="read_file"),
        *(step(i, "error_recovery", "retry") for i in (3, 4, 5)),
        step(6, "observation", "done"),
    ]
    return make_trace(steps=steps, trace_id=trace_id)


def invalid_trace() -> dict[str, Any]:
    trace = make_trace()
    trace["steps"][0]["type"] = "musing"
    del trace["outcome"]
    return trace


def lines(text: str) -> list[str]:
    """The lines printed, as they are: none wrapped, none padded."""
    return text.splitlines()


# --- evaluate ------------------------------------------------------------------------------


def test_evaluate_a_file_prints_the_breakdown(
    server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "trace.json", make_trace())
    result = run(["evaluate", "trace.json"], server.url)
    assert lines(result.stdout) == lines(BREAKDOWN)
    assert result.exit_code == 1  # 0.57625 < 0.75


@pytest.mark.parametrize(
    ("threshold", "code"), [("0.5", 0), ("0.57625", 0), ("0.5763", 1), ("0.75", 1)]
)
def test_exit_code_follows_the_threshold(
    server: Server, tmp_path: Path, threshold: str, code: int
) -> None:
    path = write(tmp_path / "trace.json", make_trace())
    result = run(["evaluate", str(path), "--threshold", threshold], server.url)
    assert result.exit_code == code, result.output
    assert ("pass" if code == 0 else "below") in result.stdout


def test_a_domain_with_no_profile_is_said(server: Server, tmp_path: Path) -> None:
    path = write(tmp_path / "trace.json", make_trace(domain="code-review"))
    result = run(["evaluate", str(path), "--dry-run"], server.url)
    assert lines(result.stdout)[:2] == [  # 103 columns on one line: two that fit 80
        "kp:trace:test-0001  score 0.5763  below (threshold 0.75)",
        "  weights: default (task_domain not recognised)",
    ]
    known = write(tmp_path / "known.json", make_trace(domain="code"))
    result = run(["evaluate", str(known), "--dry-run"], server.url)
    assert lines(result.stdout)[0].endswith("weights: code")


def test_the_novelty_line_says_what_the_model_read() -> None:
    novelty = NoveltyOut(
        measured=True, reason=None, max_cosine=0.5, cache_size=3, tokens=512, truncated=True
    )
    shown = cli_module.novelty_lines(EvaluationOut.model_construct(novelty=novelty))
    assert shown == [
        "novelty: measured, max cosine 0.500 against a cache of 3",
        "  512 tokens read, the rest past the window",
    ]


def test_parts_are_fitted_into_80_columns_and_numbers_read_as_the_service_gives_them() -> None:
    parts = ["a" * 30, "b" * 30, "c" * 30, "d" * 90]
    assert cli_module.fit(parts, first="  ") == [
        f"  {'a' * 30}; {'b' * 30}",
        f"  {'c' * 30}",
        f"  {'d' * 90}",  # a part is never split
    ]
    # 0.40125 and 0.57625 as doubles lie below and above the decimal: both read half up.
    assert [cli_module.decimals(v, 4) for v in (0.40125, 0.57625, 1.0)] == [
        "0.4013",
        "0.5763",
        "1.0000",
    ]


def test_evaluate_stdin_json_dry_run(server: Server) -> None:
    result = run(
        ["evaluate", "-", "--json", "--dry-run"], server.url, stdin=json.dumps(make_trace())
    )
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert data["trace_id"] == "kp:trace:test-0001"
    assert data["score"] == 0.57625
    assert data["overrides"] == ["low_tool_diversity"]


def test_evaluate_an_array_scores_in_order(server: Server) -> None:
    traces = [passing_trace(), make_trace()]
    result = run(["evaluate", "-", "--json"], server.url, stdin=json.dumps(traces))
    assert result.exit_code == 1  # one of the two is below 0.75
    data = json.loads(result.stdout)
    assert [d["trace_id"] for d in data] == ["kp:trace:pass", "kp:trace:test-0001"]
    assert data[0]["score"] == pytest.approx(0.87107, abs=1e-5)
    assert data[0]["overrides"] == ["error_recovery_bonus"]

    one = run(["evaluate", "-", "--json"], server.url, stdin=json.dumps({"traces": traces[:1]}))
    assert one.exit_code == 0  # the pass trace alone
    assert [d["trace_id"] for d in json.loads(one.stdout)] == ["kp:trace:pass"]  # still a list

    plain = run(["evaluate", "-", "--threshold", "0.5"], server.url, stdin=json.dumps(traces))
    assert plain.exit_code == 0
    assert plain.stdout.count("weighted sum") == 2
    assert "2 scored: 2 pass, 0 below 0.5" in plain.stdout


def test_evaluate_a_directory(
    server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "traces").mkdir()
    write(tmp_path / "traces" / "a.json", passing_trace("kp:trace:a"))
    write(tmp_path / "traces" / "b.json", make_trace(trace_id="kp:trace:[b]"))
    (tmp_path / "traces" / "notes.txt").write_text("not a trace")

    result = run(["evaluate", "traces/", "--threshold", "0.5"], server.url)
    assert result.exit_code == 0, result.output
    assert result.stderr == ""  # no progress bar: stderr is not a terminal
    # A line per trace in columns, its id and the rest beneath: 80 columns are enough.
    assert lines(result.stdout) == [
        "file    score   result  weights",
        "a.json  0.8711  pass    default",
        "  kp:trace:a; overrides: error_recovery_bonus; novelty: embedder_unavailable",
        "b.json  0.5763  pass    default",
        "  kp:trace:[b]; overrides: low_tool_diversity; novelty: embedder_unavailable",
        "2 scored: 2 pass, 0 below 0.5",
    ]
    assert max(len(line) for line in lines(result.stdout)) <= 80

    below = run(["evaluate", "traces/"], server.url)
    assert below.exit_code == 1
    assert "2 scored: 1 pass, 1 below 0.75" in below.stdout


def test_a_directory_with_bad_files_scores_the_others(server: Server, tmp_path: Path) -> None:
    write(tmp_path / "a.json", passing_trace())
    (tmp_path / "b.json").write_text("{not json")
    write(tmp_path / "c.json", invalid_trace())

    result = run(["evaluate", str(tmp_path), "--json"], server.url)
    assert result.exit_code == 2
    assert [r["trace_id"] for r in json.loads(result.stdout)] == ["kp:trace:pass"]
    assert "b.json: invalid JSON" in result.stderr
    assert "c.json: the service rejected the input (422)" in result.stderr
    assert "outcome: Field required" in result.stderr


def test_invalid_json_is_an_input_error(server: Server, tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text('{"@type": ')
    result = run(["evaluate", str(tmp_path / "bad.json")], server.url)
    assert result.exit_code == 2
    assert "invalid JSON" in result.stderr
    assert "Traceback" not in result.output


def test_a_rejected_trace_lists_the_field_paths(server: Server) -> None:
    result = run(["evaluate", "-"], server.url, stdin=json.dumps(invalid_trace()))
    assert result.exit_code == 2
    assert "the service rejected the input (422):" in result.stderr
    assert "steps.0.type: Input should be" in result.stderr
    assert "outcome: Field required" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["evaluate", "missing.json"], "cannot read missing.json"),
        (["evaluate", "-", "--threshold", "1.5"], "--threshold"),
        (["evaluate"], "Missing argument"),
        (["evaluate", "-"], "expected a JSON object"),  # stdin is "[]"
    ],
)
def test_usage_errors_exit_2(server: Server, args: list[str], message: str) -> None:
    result = run(args, server.url, stdin="[]")
    assert result.exit_code == 2
    assert message in result.stderr


def test_a_url_without_scheme_is_a_usage_error() -> None:
    result = run(["cache", "stats"], "127.0.0.1:8000")
    assert result.exit_code == 2
    assert "must start with http:// or https://" in result.stderr


def test_an_unreachable_service_exits_3(tmp_path: Path) -> None:
    path = write(tmp_path / "trace.json", make_trace())
    result = run(["evaluate", str(path)], f"http://127.0.0.1:{free_port()}")
    assert result.exit_code == 3
    assert "cannot reach kp-scoring" in result.stderr
    assert "kp-scoring serve" in result.stderr


def answering(*statuses: int, then: Server | None = None) -> tuple[httpx.MockTransport, list[int]]:
    """A transport whose first answers are `statuses` (429 or 503, Retry-After 0), then the
    live server's (`then`) or 503 again; and the statuses it has answered."""
    answered: list[int] = []
    live = httpx.HTTPTransport()

    def handle(request: httpx.Request) -> httpx.Response:
        if len(answered) < len(statuses) or then is None:
            status = statuses[min(len(answered), len(statuses) - 1)]
            answered.append(status)
            return httpx.Response(
                status, json={"detail": "busy, try again shortly"}, headers={"Retry-After": "0"}
            )
        request.url = request.url.copy_with(
            scheme="http", host="127.0.0.1", port=httpx.URL(then.url).port
        )
        response = live.handle_request(request)
        answered.append(response.status_code)
        return response

    return httpx.MockTransport(handle), answered


def through(monkeypatch: pytest.MonkeyPatch, transport: httpx.MockTransport) -> None:
    monkeypatch.setattr(
        cli_module, "KpScoringClient", functools.partial(KpScoringClient, transport=transport)
    )


@pytest.mark.parametrize(("status", "said"), [(503, "overloaded"), (429, "rate limited")])
def test_a_busy_service_exits_4_after_the_retries(
    monkeypatch: pytest.MonkeyPatch, status: int, said: str
) -> None:
    """429 and 503 are "try later", not bad input (2) nor unreachable (3)."""
    transport, answered = answering(status)
    through(monkeypatch, transport)
    result = run(["evaluate", "-"], "http://kp.invalid", stdin=json.dumps(make_trace()))
    assert result.exit_code == 4
    assert answered == [status] * 3  # the first try and the two default retries
    assert f"the service is {said}" in result.stderr
    assert "busy, try again shortly" in result.stderr
    assert "nothing was scored; try again in 0 s" in result.stderr
    assert "rejected" not in result.stderr


def test_a_retry_after_a_503_scores_the_trace(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    transport, answered = answering(503, 429, then=server)
    through(monkeypatch, transport)
    trace = json.dumps(make_trace())
    result = run(["evaluate", "-", "--json", "--dry-run"], server.url, stdin=trace)
    assert result.exit_code == 1, result.output  # scored: below the threshold
    assert answered == [503, 429, 200]
    assert json.loads(result.stdout)["score"] == 0.57625
    transport, answered = answering(503, then=server)
    through(monkeypatch, transport)
    result = run(["evaluate", "-", "--retries", "0"], server.url, stdin=trace)
    assert (result.exit_code, answered) == (4, [503])


def test_a_rate_limited_key_exits_4_at_once_when_the_wait_is_long(
    keyed: Server, tmp_path: Path
) -> None:
    """The key `slow` has one request a minute: the second is refused with a Retry-After
    longer than --max-wait, so the command does not wait for it and says when to come back."""
    path = str(write(tmp_path / "trace.json", make_trace()))
    first = run(["evaluate", path, "--dry-run", "--api-key", SLOW], keyed.url)
    assert first.exit_code == 1, first.output
    again = run(["evaluate", path, "--dry-run", "--api-key", SLOW, "--max-wait", "5"], keyed.url)
    assert again.exit_code == 4, again.output
    match = re.search(
        r"rate limited \(429 Too Many Requests: .*\): nothing was scored; "
        r"try again in (\d+) s",
        " ".join(again.stderr.split()),
    )
    assert match, again.stderr
    assert 5 < int(match[1]) <= 60


# --- cache ---------------------------------------------------------------------------------


def test_cache_stats_needs_the_token(server: Server) -> None:
    missing = run(["cache", "stats"], server.url)
    assert missing.exit_code == 2
    assert "wants an admin token" in missing.stderr
    wrong = run(["cache", "stats", "--token", "nope"], server.url)
    assert wrong.exit_code == 2
    assert "refused the admin token" in wrong.stderr

    shown = run(["cache", "stats", "--token", TOKEN], server.url)
    assert shown.exit_code == 0, shown.output
    assert {"size", "capacity", "embedder"} <= {line.split()[0] for line in lines(shown.stdout)}
    assert "disabled" in shown.stdout

    as_json = run(["cache", "stats", "--json"], server.url, KP_ADMIN_TOKEN=TOKEN)
    assert as_json.exit_code == 0
    assert json.loads(as_json.stdout)["capacity"] == 1000


def test_the_examples_summary_fits_80_columns_whatever_the_memory(onnx_server: Server) -> None:
    """kp-scoring evaluate examples/ against an empty memory, then against one that holds
    every example (each trace's nearest is itself, its id up to 45 characters): no line over
    80 columns."""
    examples = str(Path(__file__).resolve().parents[1] / "examples")
    assert run(["cache", "reset", "--token", TOKEN], onnx_server.url).exit_code == 0
    first = run(["evaluate", examples], onnx_server.url)
    again = run(["evaluate", examples, "--dry-run"], onnx_server.url)
    for result in (first, again):
        assert result.exit_code == 1, result.output
        assert max(len(line) for line in lines(result.stdout)) <= 80, result.stdout
    assert "  nearest kp:trace:550e8400-e29b-41d4-a716-446655440000 (1.000, " in again.stdout
    assert run(["cache", "reset", "--token", TOKEN], onnx_server.url).exit_code == 0


def test_cache_reset_and_dry_run(onnx_server: Server, tmp_path: Path) -> None:
    """With the real embedder: --dry-run adds nothing, a plain run adds, reset empties."""
    path = str(write(tmp_path / "trace.json", make_trace()))

    def size() -> int:
        result = run(["cache", "stats", "--json", "--token", TOKEN], onnx_server.url)
        return int(json.loads(result.stdout)["size"])

    assert run(["cache", "reset", "--token", TOKEN], onnx_server.url).exit_code == 0
    assert run(["evaluate", path, "--dry-run"], onnx_server.url).exit_code == 1
    assert size() == 0
    assert run(["evaluate", path], onnx_server.url).exit_code == 1
    assert size() == 1
    # Its twin is measured against it, and the answer names it: breakdown and table.
    again = run(["evaluate", path, "--dry-run"], onnx_server.url)
    assert "nearest kp:trace:test-0001 (1.000, " in " ".join(again.stdout.split())
    (tmp_path / "two").mkdir()
    write(tmp_path / "two" / "t.json", make_trace(trace_id="kp:trace:twin"))
    table = run(["evaluate", str(tmp_path / "two"), "--dry-run"], onnx_server.url)
    assert "\n  nearest kp:trace:test-0001 (" in table.stdout
    reset = run(["cache", "reset"], onnx_server.url, KP_ADMIN_TOKEN=TOKEN)
    assert reset.exit_code == 0
    assert reset.stdout.strip() == "cleared 1 cached vectors"
    assert size() == 0
    denied = run(["cache", "reset"], onnx_server.url)
    assert denied.exit_code == 2


# --- the installed script ------------------------------------------------------------------


def script(
    *args: str, url: str, stdin: str | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KP_", "FORCE_COLOR"))}
    env |= {"KP_URL": url, "COLUMNS": "40"}  # a pipe: COLUMNS does not matter
    return subprocess.run(
        [entry_point(), *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=30,
        check=False,
    )


def test_the_installed_script(server: Server, tmp_path: Path) -> None:
    write(tmp_path / "trace.json", make_trace())
    scored = script("evaluate", "trace.json", url=server.url, cwd=tmp_path)
    assert scored.returncode == 1
    assert lines(scored.stdout) == lines(BREAKDOWN)

    piped = script(
        "evaluate",
        "-",
        "--json",
        "--threshold",
        "0.5",
        url=server.url,
        stdin=json.dumps(make_trace()),
    )
    assert piped.returncode == 0
    assert json.loads(piped.stdout)["score"] == 0.57625

    down = script("evaluate", "trace.json", url=f"http://127.0.0.1:{free_port()}", cwd=tmp_path)
    assert down.returncode == 3
    assert "cannot reach kp-scoring" in down.stderr
    assert "Traceback" not in down.stderr


def test_help_to_a_pipe_is_plain_unpadded_and_unwrapped() -> None:
    """Not a terminal: click's plain help, every paragraph on one line, no box, no padding."""
    helps = {}
    for command in ((), ("contribution",), ("cache", "stats")):  # the group, a command, a sub's
        shown = script(*command, "--help", url="http://127.0.0.1:1")
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.startswith("Usage: kp-scoring"), shown.stdout
        assert not [line for line in lines(shown.stdout) if line != line.rstrip()], command
        assert not set("╭╮╰╯│─") & set(shown.stdout), command
        helps[command] = shown.stdout
    whole = (
        "Show what contributing a trace would send: the trace as the reference SDK's capture "
        "cleans it (POST /contribution), or with --findings what was found and what is suspected."
    )
    assert f"  {whole}\n" in helps[("contribution",)]  # one paragraph, one line
    assert f"  contribution  {whole}\n" in helps[()]


def test_a_progress_bar_only_on_a_terminal(server: Server, tmp_path: Path) -> None:
    """stderr a terminal (a pseudo-terminal here): the bar is drawn there; the summary on
    stdout, a pipe, stays plain."""
    write(tmp_path / "a.json", make_trace())
    controller, terminal = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KP_", "FORCE_COLOR"))}
    try:
        done = subprocess.run(
            [entry_point(), "evaluate", str(tmp_path), "--dry-run"],
            stdout=subprocess.PIPE,
            stderr=terminal,
            env=env | {"KP_URL": server.url, "TERM": "xterm"},
            timeout=30,
            check=False,
        )
        os.close(terminal)
        drawn = b""
        with contextlib.suppress(OSError):  # EIO once the terminal's last holder closed it
            while chunk := os.read(controller, 65536):
                drawn += chunk
    finally:
        os.close(controller)
    assert done.returncode == 1
    assert "━" in drawn.decode(errors="replace")
    assert done.stdout.decode().startswith("file    score   result  weights\n")


@pytest.mark.server
def test_serve_runs_the_service() -> None:
    with running_server(command=[entry_point(), "serve"]) as s, KpScoringClient(s.url) as kp:
        assert kp.health()
        assert kp.evaluate(make_trace()).score == pytest.approx(0.57625, abs=1e-12)
