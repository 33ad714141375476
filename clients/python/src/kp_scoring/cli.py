"""The `kp-scoring` command: score traces from files, check signed scores, look after the
cache, and run the service where it is installed. The exit codes are `Code` (and `--help`).

Everything printed that came from the service or from a file (trace ids, the nearest stored
trace's id, error messages, file names) goes through `visible`: control and bidirectional
characters are shown as escapes, never sent to the terminal. `--json` output is JSON with
ASCII escapes, so it holds none either.

Printed for the medium: on a terminal, colours, lines wrapped at its width, rich's help and a
progress bar; to a pipe or a file, plain lines as long as they are, with no padding at their
ends (`say`, `aligned`), click's plain help unwrapped and no progress bar, so that what a
script captures does not depend on COLUMNS. Summaries are laid out to fit 80 columns (`fit`).
"""

from __future__ import annotations

import inspect
import json
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from enum import IntEnum
from importlib.metadata import entry_points
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.cells import cell_len
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from kp_scoring import __version__
from kp_scoring.client import (
    DEFAULT_URL,
    KpScoringClient,
    KpScoringError,
    SignatureInvalidError,
    TryLater,
    Unauthorized,
    Unreachable,
    verify_signature,
)
from kp_scoring.models import ContributionOut, EvaluationOut
from kp_scoring.signatures import DEFAULT_LEEWAY_S, is_contribution_answer
from kp_scoring.text import visible

# The reference SDK captures a trace when its score reaches this value.
DEFAULT_THRESHOLD = 0.75

OVERRIDE_EFFECTS = {
    "single_thought": "a single thought step: score set to 0.1",
    "error_recovery_bonus": "more than 2 error recoveries and success: +0.1",
    "low_tool_diversity": "tools used, but at most one distinct tool: -0.1",
}


class Code(IntEnum):
    """Exit codes (docs/clients.md lists them too)."""

    OK = 0
    #: evaluate: a score is below the threshold; verify: the signature does not verify.
    BELOW_THRESHOLD = 1
    #: Usage or input error: bad arguments, unreadable file, bad JSON, a trace the service
    #: rejects (4xx other than 429), a missing or refused key.
    INPUT_ERROR = 2
    #: No answer from the service, or a server error (5xx other than 503).
    UNREACHABLE = 3
    #: Try later: rate limited (429) or overloaded (503); nothing was scored. The message says
    #: after how long (the answer's Retry-After), once the retries (--retries) are spent.
    TRY_LATER = 4


EXIT_CODES = """\b
Exit codes:
  0  done (evaluate: every score at or above the threshold; verify: valid)
  1  evaluate: a score below the threshold; verify: the signature does not verify
  2  bad input or usage: unreadable file, bad JSON, a trace the service rejects, a key refused
  3  the service is unreachable or failed (5xx other than 503)
  4  try later: rate limited (429) or overloaded (503); nothing was scored"""


out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


def say(*objects: Any, **options: Any) -> None:
    """Print to stdout: wrapped at a terminal's width, never when written to a pipe or file."""
    out.print(*objects, soft_wrap=not out.is_terminal, **options)


#: The width summaries are laid out for: a terminal's classic width, whatever COLUMNS says.
LAYOUT_WIDTH = 80


def fit(parts: list[str], *, first: str = "", rest: str = "  ", sep: str = "; ") -> list[str]:
    """`parts` joined by `sep` into lines of at most LAYOUT_WIDTH columns, the first begun
    with `first`, the others with `rest`; a part is never split (one longer than a line is a
    line of its own)."""
    return [
        (rest if i else first) + sep.join(parts[k] for k in line)
        for i, line in enumerate(fit_groups(parts, first=first, rest=rest, sep=sep))
    ]


def fit_groups(parts: list[str], *, first: str, rest: str, sep: str) -> list[list[int]]:
    """Which parts (by index) `fit` puts on each line."""
    lines: list[list[int]] = []
    line: list[int] = []
    width = 0
    for k, part in enumerate(parts):
        prefix = rest if lines else first
        joined = width + cell_len(sep) + cell_len(part) if line else cell_len(part)
        if line and cell_len(prefix) + joined > LAYOUT_WIDTH:
            lines.append(line)
            line, joined = [], cell_len(part)
        line.append(k)
        width = joined
    if line:
        lines.append(line)
    return lines


def decimals(value: float, places: int) -> str:
    """`value` to `places` decimals, half up from its shortest decimal form, so that a score
    the service gives as 0.40125 reads 0.4013 (its binary double lies a hair below 0.40125)."""
    step = Decimal(1).scaleb(-places)
    return str(Decimal(repr(value)).quantize(step, rounding=ROUND_HALF_UP))


def aligned(rows: list[list[str | tuple[str, str]]]) -> list[Text]:
    """Rows of cells (text, or (text, style)) in left-aligned columns two spaces apart, each
    line without trailing spaces: the same on a terminal and in a file."""
    cells = [[c if isinstance(c, tuple) else (c, "") for c in row] for row in rows]
    widths = [
        max(cell_len(row[i][0]) for row in cells if i < len(row)) for i in range(len(cells[0]))
    ]
    lines = []
    for row in cells:
        line = Text()
        for i, (text, style) in enumerate(row):
            line.append(text, style)
            if i < len(row) - 1:
                line.append(" " * (widths[i] - cell_len(text) + 2))
        line.rstrip()
        lines.append(line)
    return lines


cli = typer.Typer(
    name="kp-scoring",
    help="KnowledgePulse trace scoring: score traces, check signed scores, manage the cache, "
    "run the service.\n\n" + EXIT_CODES,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
cache_cli = typer.Typer(help="Inspect or empty the novelty cache.", no_args_is_help=True)
cli.add_typer(cache_cli, name="cache")

Url = Annotated[
    str, typer.Option("--url", envvar="KP_URL", help="The service's base URL.", show_envvar=True)
]
Token = Annotated[
    str | None,
    typer.Option(
        "--token", envvar="KP_ADMIN_TOKEN", help="Admin token for /cache.", show_envvar=True
    ),
]
ApiKey = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        envvar="KP_API_KEY",
        help="API key for scoring (when the service has KP_API_KEYS_FILE).",
        show_envvar=True,
    ),
]
Namespace = Annotated[
    str | None,
    typer.Option(
        "--namespace",
        envvar="KP_NAMESPACE",
        help="The namespace (the memory) to act on, sent as KP-Namespace; default the API "
        "key's namespace, else 'default'.",
        show_envvar=True,
    ),
]
AsJson = Annotated[bool, typer.Option("--json", help="Print the raw JSON answer.")]
Retries = Annotated[
    int,
    typer.Option(
        min=0,
        help="Times to send a request again after a 429 or 503, each after its Retry-After.",
    ),
]
MaxWait = Annotated[
    float,
    typer.Option(
        min=0,
        help="Longest Retry-After (seconds) to wait for; a longer one exits 4 at once.",
    ),
]
DEFAULT_RETRIES = 2
DEFAULT_MAX_WAIT = 30.0


def show_version(value: bool) -> None:
    if value:
        typer.echo(f"kp-scoring {__version__}")
        raise typer.Exit()


@cli.callback()
def main_options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=show_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    pass


class InputError(ValueError):
    """A trace file that cannot be read or parsed."""


def fail(message: str, code: Code) -> typer.Exit:
    err.print(f"kp-scoring: {message}", markup=False, style="red", soft_wrap=True)
    return typer.Exit(code)


@contextmanager
def service_errors(token: str | None = None, *, api_key: bool = False) -> Iterator[None]:
    """Turns client errors into a plain message and the matching exit code. `api_key`: the
    request needed an API key (scoring) rather than the admin token."""
    try:
        yield
    except Unreachable as exc:
        raise fail(
            f"{exc}\nIs the service running? Start it with `kp-scoring serve`, "
            "or point --url (or KP_URL) at it.",
            Code.UNREACHABLE,
        ) from None
    except TryLater as exc:
        raise fail(try_later(exc), Code.TRY_LATER) from None
    except Unauthorized:
        if api_key:
            raise fail(
                f"the service {'refused the API key' if token else 'wants an API key'}: "
                "pass --api-key or set KP_API_KEY",
                Code.INPUT_ERROR,
            ) from None
        problem = "refused the admin token" if token else "wants an admin token"
        raise fail(
            f"the service {problem}: pass --token or set KP_ADMIN_TOKEN", Code.INPUT_ERROR
        ) from None
    except KpScoringError as exc:
        raise fail(describe(exc), exit_code(exc)) from None


def connect(
    url: str,
    token: str | None = None,
    api_key: str | None = None,
    *,
    namespace: str | None = None,
    retries: int = DEFAULT_RETRIES,
    max_wait: float = DEFAULT_MAX_WAIT,
) -> KpScoringClient:
    if not url.startswith(("http://", "https://")):
        raise fail(
            f"--url (or KP_URL) must start with http:// or https://, got {visible(url)!r}",
            Code.INPUT_ERROR,
        )
    return KpScoringClient(
        url,
        admin_token=token,
        api_key=api_key,
        namespace=namespace,
        retries=retries,
        max_retry_wait=max_wait,
    )


def exit_code(exc: KpScoringError) -> Code:
    if isinstance(exc, TryLater):
        return Code.TRY_LATER
    if exc.status_code is not None and 400 <= exc.status_code < 500:
        return Code.INPUT_ERROR
    return Code.UNREACHABLE


def try_later(exc: TryLater) -> str:
    what = "rate limited" if exc.status_code == 429 else "overloaded"
    when = "later" if exc.retry_after is None else f"in {exc.retry_after:g} s"
    return f"the service is {what} ({exc}): nothing was scored; try again {when}"


def describe(exc: KpScoringError) -> str:
    """A client error as lines a person reads: one per field path when the service gave them."""
    if isinstance(exc, TryLater):
        return try_later(exc)
    if not exc.errors:
        return str(exc)
    lines = [f"the service rejected the input ({exc.status_code}):"]
    for e in exc.errors:
        loc = e.loc[1:] if len(e.loc) > 1 and e.loc[0] == "body" else e.loc
        lines.append(visible(f"  {'.'.join(str(p) for p in loc)}: {e.msg}"))
    return "\n".join(lines)


def load_traces(text: str, source: str) -> tuple[list[Any], bool]:
    """The traces of a JSON document (one trace, an array, or {"traces": [...]}); many or one."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{visible(source)}: invalid JSON: {exc}") from None
    if isinstance(document, dict) and isinstance(document.get("traces"), list):
        document = document["traces"]
    traces = document if isinstance(document, list) else [document]
    if not traces or not all(isinstance(t, dict) for t in traces):
        raise InputError(
            f"{visible(source)}: expected a JSON object (one trace) or a non-empty array of objects"
        )
    return traces, isinstance(document, list)


def read_source(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise InputError(f"cannot read {visible(path)}: {visible(reason)}") from None


def score(kp: KpScoringClient, traces: list[Any], dry_run: bool) -> list[EvaluationOut]:
    if len(traces) == 1:
        return [kp.evaluate(traces[0], dry_run=dry_run)]
    return kp.evaluate_batch(traces, dry_run=dry_run)


def verdict(value: float, threshold: float) -> str:
    return "[green]pass[/]" if value >= threshold else "[red]below[/]"


def verdict_cell(value: float, threshold: float) -> tuple[str, str]:
    return ("pass", "green") if value >= threshold else ("below", "red")


def shown(text: object) -> str:
    """Text from the service or a file, for a rich markup string: visible, markup escaped."""
    return escape(visible(text))


def print_breakdown(r: EvaluationOut, threshold: float) -> None:
    score = decimals(r.score, 4)
    head = [  # (plain, with markup)
        (visible(r.trace_id), f"[bold]{shown(r.trace_id)}[/]"),
        (f"score {score}", f"score [bold]{score}[/]"),
        (
            f"{verdict_cell(r.score, threshold)[0]} (threshold {threshold})",
            f"{verdict(r.score, threshold)} (threshold {threshold})",
        ),
        (f"weights: {visible(weights_text(r))}", f"weights: {shown(weights_text(r))}"),
    ]
    plain = [text for text, _ in head]
    for i, group in enumerate(fit_groups(plain, first="", rest="  ", sep="  ")):
        say(("  " if i else "") + "  ".join(head[k][1] for k in group))
    bold = "bold"
    rows: list[list[str | tuple[str, str]]] = [
        [("dimension", bold), ("value", bold), ("weight", bold), ("weighted", bold)]
    ]
    total = 0.0
    for name in ("complexity", "novelty", "tool_diversity", "outcome_confidence"):
        value, weight = getattr(r.dimensions, name), getattr(r.weights, name)
        total += value * weight
        weighted = decimals(value * weight, 3)
        rows.append([name, decimals(value, 3), decimals(weight, 2), weighted])
    rows.append(["weighted sum", "", "", decimals(total, 3)])
    for row in aligned(rows):
        say(row)
    rules = [f"{visible(rule)} ({OVERRIDE_EFFECTS.get(rule, '?')})" for rule in r.overrides]
    for text in [*fit(["overrides: " + (rules[0] if rules else "none"), *rules[1:]])]:
        say(text, markup=False)
    for text in novelty_lines(r):
        say(text, markup=False)


def weights_text(r: EvaluationOut) -> str:
    """The profile that applied, and when the trace's task_domain named none, that it did not."""
    unknown = r.profile is not None and not r.profile.domain_recognised
    return r.weights.profile + (" (task_domain not recognised)" if unknown else "")


def novelty_lines(r: EvaluationOut) -> list[str]:
    """The novelty of a breakdown: how it was measured, the nearest stored trace, the tokens
    read, in lines that fit LAYOUT_WIDTH (their continuations indented)."""
    n = r.novelty
    parts = []
    if n.measured:
        parts.append(
            f"novelty: measured, max cosine {decimals(n.max_cosine or 0.0, 3)} against a cache "
            f"of {n.cache_size}"
        )
        if n.nearest is not None:
            parts.append(f"nearest {nearest_text(r)}")
        if n.search == "index":
            parts.append(f"approximate search: within {n.search_bound:g} of the exact maximum")
    else:
        detail = f": {visible(n.detail)}" if n.detail else ""
        parts.append(f"novelty: not measured ({visible(n.reason)}{detail})")
    if n.tokens is not None:
        parts.append(
            f"{n.tokens} tokens read" + (", the rest past the window" if n.truncated else "")
        )
    return fit(parts)


def nearest_text(r: EvaluationOut) -> str:
    """The stored trace this one resembles most: its id and how long ago it was stored."""
    nearest = r.novelty.nearest
    if nearest is None:
        return "-"
    when = f"{decimals(nearest.cosine, 3)}, {nearest.age_ms / 1000:.1f} s ago"
    return f"{visible(nearest.trace_id) or '?'} ({when})"


def print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2))


@cli.command()
def evaluate(
    path: Annotated[
        str,
        typer.Argument(
            help="A JSON file (one trace, or an array of traces), '-' for stdin, "
            "or a directory of *.json traces.",
            metavar="PATH",
            show_default=False,
        ),
    ],
    url: Url = DEFAULT_URL,
    threshold: Annotated[
        float,
        typer.Option(min=0.0, max=1.0, help="Exit 1 when a score is below this value."),
    ] = DEFAULT_THRESHOLD,
    as_json: AsJson = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Score without adding the traces to the cache.")
    ] = False,
    api_key: ApiKey = None,
    namespace: Namespace = None,
    retries: Retries = DEFAULT_RETRIES,
    max_wait: MaxWait = DEFAULT_MAX_WAIT,
) -> None:
    """Score traces and print their breakdown.

    Exit code: 0 all scores >= threshold, 1 some below, 2 bad input, 3 service unreachable,
    4 try later (429 or 503).
    """
    kp = connect(url, api_key=api_key, namespace=namespace, retries=retries, max_wait=max_wait)
    with kp, service_errors(api_key, api_key=True):
        if path != "-" and Path(path).is_dir():
            results, failures = evaluate_directory(kp, Path(path), dry_run, threshold, as_json)
        else:
            try:
                source = "stdin" if path == "-" else path
                traces, many = load_traces(read_source(path), source)
            except InputError as exc:
                raise fail(str(exc), Code.INPUT_ERROR) from None
            results, failures = score(kp, traces, dry_run), 0
            if as_json:
                dumped = [r.model_dump(mode="json") for r in results]
                print_json(dumped if many else dumped[0])
            else:
                for i, r in enumerate(results):
                    if i:
                        say()
                    print_breakdown(r, threshold)
    below = sum(r.score < threshold for r in results)
    if not as_json and len(results) + failures > 1:
        say(
            f"{len(results)} scored: {len(results) - below} pass, {below} below {threshold}"
            + (f", {failures} failed" if failures else ""),
            markup=False,
        )
    if failures:
        raise typer.Exit(Code.INPUT_ERROR)
    if below:
        raise typer.Exit(Code.BELOW_THRESHOLD)


@cli.command()
def contribution(
    path: Annotated[
        str,
        typer.Argument(
            help="A JSON file holding one trace, or '-' for stdin.",
            metavar="FILE",
            show_default=False,
        ),
    ],
    url: Url = DEFAULT_URL,
    findings: Annotated[
        bool,
        typer.Option(
            "--findings",
            help="Print the score, what was redacted, what would go uncleaned, what is "
            "suspected (by detector) and the injection check, instead of the cleaned trace.",
        ),
    ] = False,
    as_json: AsJson = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Score without adding the trace to the cache.")
    ] = False,
    redact_suspected: Annotated[
        bool,
        typer.Option(
            "--redact-suspected",
            help="Also redact every suspected leak (the contribution then differs from the SDK's).",
        ),
    ] = False,
    api_key: ApiKey = None,
    retries: Retries = DEFAULT_RETRIES,
    max_wait: MaxWait = DEFAULT_MAX_WAIT,
) -> None:
    """Show what contributing a trace would send: the trace as the reference SDK's capture
    cleans it (POST /contribution), or with --findings what was found and what is suspected.

    Exit code: 0 the SDK would contribute it (score >= the service's threshold), 1 it would
    not, 2 bad input, 3 service unreachable, 4 try later (429 or 503).
    """
    kp = connect(url, api_key=api_key, retries=retries, max_wait=max_wait)
    with kp, service_errors(api_key, api_key=True):
        try:
            traces, many = load_traces(read_source(path), "stdin" if path == "-" else path)
            if many:
                raise InputError(f"{visible(path)}: one trace, not an array")
        except InputError as exc:
            raise fail(str(exc), Code.INPUT_ERROR) from None
        answer = kp.contribution(
            traces[0], dry_run=dry_run, redact_suspected=True if redact_suspected else None
        )
    if as_json:
        print_json(answer.model_dump(mode="json"))
    elif findings:
        print_findings(answer)
    else:
        print_json(answer.contribution)
    if not answer.shareable:
        raise typer.Exit(Code.BELOW_THRESHOLD)


def print_findings(answer: ContributionOut) -> None:
    # Plain lines, never wrapped: a path or a pattern name is read whole.
    e = answer.evaluation
    would = "would" if answer.shareable else "would not"
    typer.echo(
        f"{visible(e.trace_id)}: score {decimals(e.score, 4)}, the SDK's capture {would} "
        f"contribute it (threshold {answer.threshold:g})"
    )
    if answer.leaks_remain is not None:
        typer.echo(
            "  leaks remain in what would be contributed"
            if answer.leaks_remain
            else "  nothing suspected remains in what would be contributed"
        )
    if answer.differs_from_sdk:
        typer.echo("  the contribution differs from the SDK's: the service redacted more")
    sections = (
        ("redacted", answer.redactions),
        ("left uncleaned", answer.uncleaned),
        ("suspected", answer.findings),
    )
    for title, found in sections:
        if not found:
            typer.echo(f"  {title}: nothing")
            continue
        typer.echo(f"  {title}:")
        for f in found:
            by = "" if f.detector in (None, "cleanPii") else f" ({visible(f.detector)})"
            typer.echo(f"    {visible(f.path)}: {visible(f.type)} x{f.count}{by}")
    for kept in answer.inputs_kept:
        typer.echo(f"  sent as it was (its cleaned JSON did not parse): {visible(kept)}")
    risky = [r for r in answer.injection.fields if r.patterns]
    if not risky:
        typer.echo("  injection check: nothing matched")
    for r in risky:
        typer.echo(
            f"  injection check: {visible(r.path)} {r.verdict} ({r.score:g}): "
            + ", ".join(visible(p) for p in r.patterns)
        )


@dataclass
class FileResult:
    file: str
    results: list[EvaluationOut]
    error: str | None = None


def evaluate_directory(
    kp: KpScoringClient, directory: Path, dry_run: bool, threshold: float, as_json: bool
) -> tuple[list[EvaluationOut], int]:
    """Scores each *.json file in turn; a bad file is reported and the others still scored."""
    files = sorted(p for p in directory.glob("*.json") if p.is_file())
    if not files:
        raise fail(f"no *.json files in {visible(directory)}", Code.INPUT_ERROR)
    done: list[FileResult] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    # A bar for a person watching a terminal; a redirected stderr gets none, not its last frame.
    quiet = not err.is_terminal
    with Progress(*columns, TimeElapsedColumn(), console=err, disable=quiet) as progress:
        task = progress.add_task("scoring", total=len(files))
        for file in files:
            progress.update(task, description=f"scoring {shown(file.name)}")
            try:
                traces, _ = load_traces(read_source(str(file)), file.name)
                done.append(FileResult(file.name, score(kp, traces, dry_run)))
            except InputError as exc:
                done.append(FileResult(file.name, [], str(exc)))
            except KpScoringError as exc:
                if exit_code(exc) is not Code.INPUT_ERROR:
                    raise
                done.append(FileResult(file.name, [], f"{visible(file.name)}: {describe(exc)}"))
            progress.advance(task)
        progress.update(task, description=f"scored {len(files)} files")
    results = [r for f in done for r in f.results]
    if as_json:
        print_json([r.model_dump(mode="json") for r in results])
    else:
        print_summary(done, threshold)
    for f in done:
        if f.error:
            err.print(f"kp-scoring: {f.error}", markup=False, style="red", soft_wrap=True)
    return results, sum(f.error is not None for f in done)


def print_summary(done: list[FileResult], threshold: float) -> None:
    """One line per trace in columns that fit 80 (file, score, result, weights), and beneath
    it, indented, what identifies and explains it: the trace id, the overrides, novelty (and
    the nearest stored trace when it was measured)."""
    bold = "bold"
    header: list[str | tuple[str, str]] = [
        ("file", bold),
        ("score", bold),
        ("result", bold),
        ("weights", bold),
    ]
    rows: list[list[str | tuple[str, str]]] = [header]
    details: list[list[str] | None] = [None]
    for f in done:
        if f.error:
            rows.append([visible(f.file), "", ("error", "red")])
            details.append(None)
        for r in f.results:
            rows.append(
                [
                    visible(f.file),
                    decimals(r.score, 4),
                    verdict_cell(r.score, threshold),
                    visible(weights_text(r)),
                ]
            )
            details.append(summary_detail(r))
    for line, detail in zip(aligned(rows), details, strict=True):
        say(line)
        for part in detail or []:
            say(part, markup=False)


def summary_detail(r: EvaluationOut) -> list[str]:
    """What identifies and explains a row, indented beneath it, in lines that fit
    LAYOUT_WIDTH."""
    novelty = (
        f"measured, max cosine {decimals(r.novelty.max_cosine, 3)}"
        if r.novelty.measured and r.novelty.max_cosine is not None
        else visible(r.novelty.reason)
    )
    parts = [
        visible(r.trace_id),
        f"overrides: {visible(', '.join(r.overrides)) or 'none'}",
        f"novelty: {novelty}",
    ]
    if r.novelty.nearest is not None:
        parts.append(f"nearest {nearest_text(r)}")
    return fit(parts, first="  ")


@cli.command()
def verify(
    trace_path: Annotated[
        str,
        typer.Argument(
            help="The trace as it was sent (a JSON file, '-' for stdin).", metavar="TRACE"
        ),
    ],
    signature: Annotated[
        str,
        typer.Argument(
            help="The answer's signature (a compact JWS), or a JSON file holding the answer "
            "(of /evaluate or /contribution).",
            metavar="SIGNATURE",
        ),
    ],
    jwks_path: Annotated[
        Path | None,
        typer.Option("--jwks", help="A JWKS file; default: the service's /.well-known/jwks.json."),
    ] = None,
    issuer: Annotated[
        str | None,
        typer.Option("--issuer", help="Require this signer (the signed iss)."),
    ] = None,
    audience: Annotated[
        str | None,
        typer.Option(
            "--audience",
            help="Who you are, when the service signs for an audience (the signed aud).",
        ),
    ] = None,
    committed: Annotated[
        bool,
        typer.Option(
            "--committed",
            help="Require a committed score: not a dry run (the trace entered the memory).",
        ),
    ] = False,
    leeway: Annotated[
        float,
        typer.Option(
            "--leeway",
            min=0,
            help="Seconds an expired signature (exp) still verifies, for clocks that disagree.",
        ),
    ] = DEFAULT_LEEWAY_S,
    url: Url = DEFAULT_URL,
    as_json: AsJson = False,
) -> None:
    """Check a signed score against the trace and the service's public keys.

    Given an answer's JSON file (of POST /evaluate, or of POST /contribution: then its
    contribution must be the one signed too), every field it shows but elapsed_ms (trace_id, score,
    dimensions, weights, profile, overrides, novelty and all it holds, and any field a newer
    service adds) must be the signed one, none missing or added: an edited answer does not
    verify. A signature past its expiry (exp) does not verify once the leeway (--leeway,
    5 s unless given) is spent.

    Exit code: 0 the signature verifies and is about this trace, 1 it does not, 2 bad input,
    3 service unreachable (when the JWKS is fetched from it), 4 try later (429 or 503).
    """
    try:
        traces, many = load_traces(read_source(trace_path), trace_path)
        if many:
            raise InputError(
                f"{visible(trace_path)}: one trace, not an array: a signature is about one"
            )
        trace = traces[0]
        token, answer, contribution = _signature_of(signature)
        jwks = json.loads(read_source(str(jwks_path))) if jwks_path is not None else None
    except ValueError as exc:  # InputError, or a JWKS file that is not JSON
        raise fail(visible(exc), Code.INPUT_ERROR) from None
    if jwks is None:
        with connect(url) as kp, service_errors():
            jwks = kp.jwks()
    try:
        claims = verify_signature(
            token,
            trace,
            jwks,
            issuer=issuer,
            audience=audience,
            committed=committed,
            answer=answer,
            leeway_s=leeway,
            contribution=contribution,
        )
    except SignatureInvalidError as exc:
        raise fail(f"invalid: {visible(exc)}", Code.BELOW_THRESHOLD) from None
    if as_json:
        print_json(claims)
        return
    signed = claims.get("answer")
    if not isinstance(signed, dict):
        signed = {}
    say(
        f"valid: {shown(signed.get('trace_id'))} scored {shown(signed.get('score'))} "
        f"by {shown(claims.get('iss'))}"
        + (" (a dry run: not in the memory)" if claims.get("dry_run") is True else ""),
    )


_COMPACT_JWS = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*\.[A-Za-z0-9_-]*")


def _signature_of(value: str) -> tuple[str, dict[str, Any] | None, Any]:
    """A compact JWS as given, or the `signature` of an answer in a JSON file and the answer
    (whose fields are then checked against the signed answer); for a POST /contribution
    answer, its `evaluation`'s (the whole answer is checked, its contribution too)."""
    if _COMPACT_JWS.fullmatch(value):
        return value, None, None
    try:
        answer = json.loads(read_source(value))
    except json.JSONDecodeError as exc:
        raise InputError(
            f"{visible(value)}: neither a compact JWS nor an answer's JSON: {exc}"
        ) from None
    # A /contribution answer is checked whole (verify reads its evaluation, its other fields
    # and its contribution); its signature is its evaluation's.
    holder = answer.get("evaluation") if is_contribution_answer(answer) else answer
    signature = holder.get("signature") if isinstance(holder, dict) else None
    if not isinstance(signature, str):
        raise InputError(
            f"{visible(value)}: the answer has no signature (the service signs nothing?)"
        )
    return signature, answer, None


@cli.command()
def serve(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")] = 8000,
) -> None:
    """Run the service (one process, served by granian); settings come from KP_* variables.
    Needs the server (the kp-scoring distribution at the repository's root), not only this
    client."""
    run = server_runner()
    if run is None:
        raise fail(SERVER_MISSING, Code.INPUT_ERROR)
    run(host, port)


SERVER_MISSING = (
    "`serve` needs the kp-scoring server, which this install lacks: in a clone of the "
    "repository, run `make run` (or `pip install ./clients/python .`)"
)


def server_runner() -> Callable[..., None] | None:
    """The server's `run`, found by the entry point the server distribution declares (group
    kp_scoring.server), so that an unrelated package named `app` is never taken for it; None
    when the server or one of its dependencies is not installed."""
    for found in entry_points(group="kp_scoring.server", name="run"):
        try:
            run: Callable[..., None] = found.load()
        except ImportError:
            return None
        return run
    return None


@cache_cli.command("stats")
def cache_stats(
    url: Url = DEFAULT_URL,
    token: Token = None,
    namespace: Namespace = None,
    as_json: AsJson = False,
) -> None:
    """Show a namespace's cache: size, limits and counters, and the embedder's state."""
    with connect(url, token, namespace=namespace) as kp, service_errors(token):
        stats = kp.cache_stats()
    if as_json:
        print_json(stats.model_dump(mode="json"))
        return
    rows: list[list[str | tuple[str, str]]] = [[("cache", "bold"), ("value", "bold")]]
    for key, value in stats.model_dump(exclude={"embedder", "backend"}).items():
        rows.append(
            [
                visible(key),
                "-"
                if value is None
                else f"{value:.1f}"
                if isinstance(value, float)
                else visible(value),
            ]
        )
    e = stats.embedder
    about = [
        e.model,
        e.weights and f"{e.weights} weights",
        e.precision and f"{e.precision} arithmetic",
    ]
    named = ", ".join(str(part) for part in about if part)
    rows.append(["embedder", visible(e.state + (f" ({named})" if named else ""))])
    if e.reason:
        rows.append(["embedder reason", visible(e.reason)])
    b = stats.backend
    where = f"shared: {b.location} (prefix {b.prefix})" if b.shared else "this process"
    rows.append(["cache", visible(where + ("" if b.available else " UNAVAILABLE"))])
    if b.reason:
        rows.append(["cache reason", visible(b.reason)])
    for line in aligned(rows):
        say(line)


@cache_cli.command("reset")
def cache_reset(url: Url = DEFAULT_URL, token: Token = None, namespace: Namespace = None) -> None:
    """Empty a namespace's cache (its novelty is measured against an empty cache afterwards)."""
    with connect(url, token, namespace=namespace) as kp, service_errors(token):
        cleared = kp.cache_reset()
    say(f"cleared {cleared} cached vectors")


@cache_cli.command("namespaces")
def cache_namespaces(url: Url = DEFAULT_URL, token: Token = None) -> None:
    """List the namespaces that hold entries, one a line."""
    with connect(url, token) as kp, service_errors(token):
        names = kp.cache_namespaces()
    for name in names:
        say(visible(name), markup=False)


def paragraphs(text: str) -> str:
    """A docstring as help: each paragraph's lines joined into one, so that neither rich (on a
    terminal) nor click (elsewhere) shows a line break where the source wrapped; a paragraph
    that begins with \\b keeps its lines (click's convention)."""
    blocks = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(b if b.startswith("\b") else " ".join(b.split("\n")) for b in blocks)


for _group in (cli, cache_cli):
    for _command in _group.registered_commands:
        if _command.help is None and _command.callback is not None:
            _command.help = paragraphs(_command.callback.__doc__ or "")

#: Help for a pipe or a file: click's own, unwrapped (typer's rich panels pad every line to
#: the console's width and wrap at 80).
PLAIN_HELP = {"terminal_width": 100_000, "max_content_width": 100_000}


def main() -> None:
    """The `kp-scoring` console script: rich's help on a terminal, plain help elsewhere."""
    if not (out.is_terminal and err.is_terminal):
        cli.rich_markup_mode = None
        cli.info.context_settings = PLAIN_HELP
    cli()


if __name__ == "__main__":
    main()
