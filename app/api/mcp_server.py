"""The MCP server behind /mcp: the MCP Python SDK's low-level server, stateless, answering in
JSON, its tools calling the service as the REST routes do (docs/api.md, MCP;
docs/decisions/mcp-in-process.md). app/api/mcp.py loads this module on the first /mcp request.

The tools' input schemas are those of the REST bodies (the trace's own fields at the top, plus
`dry_run` and `namespace`), their output schemas those of the REST answers: an agent sends the
trace it would POST and gets the answer the REST API would give.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any, Final

import mcp_types as types
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers

from app.api.edge import caller_of
from app.api.errors import shortened
from app.core import namespaces
from app.core.errors import Problem, ServiceError, invalid, problems_of
from app.core.version import VERSION
from app.schemas.contribution import ContributionOptions, ContributionOut
from app.schemas.ids import visible
from app.schemas.responses import BatchIn, BatchOut, EvaluationOut
from app.schemas.trace import ReasoningTrace
from app.service.scoring_service import Kind, Scoring, ScoringService

log = logging.getLogger(__name__)

SCORE_TRACE: Final = "kp_score_trace"
SCORE_TRACES: Final = "kp_score_traces"
CHECK_CONTRIBUTION: Final = "kp_check_contribution"
#: The reference SDK's KPCapture contributes a trace whose score reaches this (valueThreshold).
SHARE_THRESHOLD: Final = 0.75

_DRY_RUN_SCHEMA: Final[dict[str, Any]] = {
    "type": "boolean",
    "default": False,
    "description": "Score without adding the trace's embedding to the novelty cache.",
}

_NAMESPACE_SCHEMA: Final[dict[str, Any]] = {
    "type": "string",
    "pattern": namespaces.PATTERN,
    "description": "The namespace (the memory) to score in: the trace is compared only with "
    "its namespace's traces. Default: the request's KP-Namespace header, else the API key's "
    f"namespace, else {namespaces.DEFAULT!r}. A key bound to a namespace may name no other.",
}


def _input_schema(model: type[BaseModel], **more: Any) -> dict[str, Any]:
    schema = model.model_json_schema(by_alias=True)
    schema["properties"].update(dry_run=_DRY_RUN_SCHEMA, namespace=_NAMESPACE_SCHEMA, **more)
    return schema


#: kp_check_contribution's arguments beyond the trace's (POST /contribution's query).
_OPTIONS: Final = tuple(ContributionOptions.model_fields)


# Not read-only: without dry_run the trace joins the novelty cache; nothing is deleted.
_ANNOTATIONS: Final = types.ToolAnnotations(read_only_hint=False, destructive_hint=False)
_TOOLS: Final = [
    types.Tool(
        name=SCORE_TRACE,
        title="Score a reasoning trace",
        description=(
            "Score one KnowledgePulse ReasoningTrace as POST /evaluate does: the arguments "
            "are the trace's own fields plus dry_run and namespace; the answer is the "
            "value score in [0, 1] with its breakdown. A trace scoring "
            f"{SHARE_THRESHOLD} or more is worth contributing (the SDK's default "
            "threshold). dry_run=true leaves the novelty cache untouched."
        ),
        input_schema=_input_schema(ReasoningTrace),
        output_schema=EvaluationOut.model_json_schema(),
        annotations=_ANNOTATIONS,
    ),
    types.Tool(
        name=SCORE_TRACES,
        title="Score reasoning traces in order",
        description=(
            "Score traces in order, as one step, as POST /evaluate/batch does: later traces "
            "are compared with earlier ones. Arguments: traces (1 to KP_MAX_BATCH), "
            "dry_run and namespace."
        ),
        input_schema=_input_schema(BatchIn),
        output_schema=BatchOut.model_json_schema(),
        annotations=_ANNOTATIONS,
    ),
    types.Tool(
        name=CHECK_CONTRIBUTION,
        title="Check a trace before contributing it",
        description=(
            "As POST /contribution: the score (as kp_score_trace) and the trace as the "
            "reference SDK's capture would contribute it (steps cleaned of secrets and, "
            "unless privacy_level is private, identifiers), what was redacted, what would "
            "go uncleaned (objective, outcome, metadata, ...), every suspected leak the "
            "SDK's patterns leave (findings: place, type, detector), leaks_remain, and the "
            "SDK's injection check of each text field. Arguments: the trace's fields, "
            "dry_run, namespace, redact_suspected (also redact what is suspected: the "
            "contribution then differs from the SDK's) and the injection thresholds "
            "(suspicious_threshold, reject_threshold)."
        ),
        input_schema=_input_schema(
            ReasoningTrace, **ContributionOptions.model_json_schema()["properties"]
        ),
        output_schema=ContributionOut.model_json_schema(),
        annotations=_ANNOTATIONS,
    ),
]


def _field(loc: Sequence[str | int]) -> str:
    path = [shortened(str(part)) for part in loc]
    if path[:1] == ["body"]:  # the service names fields as REST body fields
        path = path[1:]
    return ".".join(path) or "(arguments)"


def tool_error(error: ServiceError) -> types.CallToolResult:
    """A refusal as a tool error naming its kind (the REST answer's `type`): field paths and
    messages only, never the input itself, cut and escaped as REST's are (a path may name a key
    of the caller's own JSON)."""
    message = shortened(error.message)
    if error.status == 422 and error.problems:
        fields = "; ".join(
            f"{_field(p.loc)}: {shortened(p.msg)} ({p.type})" for p in error.problems
        )
        text = f"invalid arguments, nothing was scored: {fields}"
    elif error.kind.startswith("namespace_"):
        text = f"namespace refused, nothing was scored: {message}"
    elif error.kind == "overloaded":
        text = f"overloaded, nothing was scored; retry in a second: {message}"
    else:
        text = f"nothing was scored: {message} ({error.kind})"
    return types.CallToolResult(content=[types.TextContent(text=visible(text))], is_error=True)


def summary(answer: EvaluationOut) -> str:
    """One line an agent (or its model) reads: the score, the verdict, the nearest trace."""
    verdict = "meets" if answer.score >= SHARE_THRESHOLD else "is below"
    line = f"score {answer.score:.6g} {verdict} the {SHARE_THRESHOLD} sharing threshold"
    if not answer.profile.domain_recognised:
        line += f"; task_domain not recognised, scored with the {answer.profile.name} weights"
    novelty = answer.novelty
    nearest = novelty.nearest  # the stored trace with the largest cosine
    if nearest is not None:
        # Stored by another caller, maybe before ids had a rule: escaped, never raw.
        name = visible(nearest.trace_id) if nearest.trace_id else "(stored without an id)"
        line += f"; nearest earlier trace {name} (cosine {nearest.cosine:.4f})"
    elif novelty.measured and novelty.max_cosine is not None:
        line += f"; max cosine {novelty.max_cosine:.4f} with {novelty.cache_size} earlier traces"
    elif novelty.reason is not None:
        line += f"; novelty not measured ({novelty.reason})"
    if novelty.search == "index":
        # Said, so that an agent does not read an approximate cosine as the exact one.
        line += " (approximate search: Redis's HNSW index, not the exact scan)"
    return line


def contribution_summary(answer: ContributionOut) -> str:
    """The score line, then what contributing would send and find."""
    line = summary(answer.evaluation)
    verdict = "would" if answer.shareable else "would not"
    line += f". The SDK's capture {verdict} contribute it (threshold {answer.threshold:g})"
    redacted = sum(f.count for f in answer.redactions)
    uncleaned = sum(f.count for f in answer.uncleaned)
    found = sum(f.count for f in answer.findings)
    line += f"; {redacted} redaction(s) in the contribution"
    if answer.differs_from_sdk:
        line += " (more than the SDK's: the contribution differs from what it would send)"
    if uncleaned:
        where = ", ".join(sorted({f.path for f in answer.uncleaned}))
        line += f"; {uncleaned} secret(s) or identifier(s) left uncleaned at {visible(where)}"
    if found:
        kinds = ", ".join(sorted({f.type for f in answer.findings}))
        where = ", ".join(sorted({f.path for f in answer.findings}))
        line += f"; {found} suspected leak(s) ({kinds}) at {visible(where)}"
    line += (
        "; leaks remain in what would be contributed"
        if answer.leaks_remain
        else "; nothing suspected remains in what would be contributed"
    )
    highest = answer.injection.highest
    if highest is not None and highest.patterns:
        line += (
            f"; injection check: {highest.verdict} at {visible(highest.path)} "
            f"({', '.join(highest.patterns)})"
        )
    return line


#: Each tool and what it scores.
_KINDS: Final[dict[str, Kind]] = {
    SCORE_TRACE: "one",
    SCORE_TRACES: "batch",
    CHECK_CONTRIBUTION: "contribution",
}


async def _list_tools(
    ctx: Any, params: types.PaginatedRequestParams | None
) -> types.ListToolsResult:
    return types.ListToolsResult(tools=_TOOLS)


async def _call_tool(
    service: ScoringService, ctx: Any, params: types.CallToolRequestParams
) -> types.CallToolResult:
    """A tool call turned into one for the service, its answer into the tool's."""
    kind = _KINDS.get(params.name)
    if kind is None:
        raise MCPError(types.INVALID_PARAMS, f"unknown tool: {params.name}")
    try:
        answer = await _call(service, ctx, kind, dict(params.arguments or {}))
    except ServiceError as exc:
        return tool_error(exc)
    except Exception:
        # As the REST API's 500: logged here, no internals in the answer.
        log.exception("mcp: unhandled error", extra={"tool": params.name})
        raise MCPError(types.INTERNAL_ERROR, "internal error") from None
    if isinstance(answer, ContributionOut):
        text = contribution_summary(answer)
    elif isinstance(answer, BatchOut):
        text = "\n".join(f"{visible(a.trace_id)}: {summary(a)}" for a in answer.results)
    else:
        assert isinstance(answer, EvaluationOut)
        text = summary(answer)
    return types.CallToolResult(
        content=[types.TextContent(text=text)], structured_content=answer.model_dump(mode="json")
    )


async def _call(
    service: ScoringService, ctx: Any, kind: Kind, arguments: dict[str, Any]
) -> BaseModel:
    # The HTTP request as Admission left it: its caller, its headers.
    scope: dict[str, Any] = getattr(getattr(ctx, "request", None), "scope", None) or {}
    headers = Headers(scope=scope) if scope else Headers()
    dry_run = arguments.pop("dry_run", False)
    if not isinstance(dry_run, bool):
        raise invalid([Problem(("dry_run",), "should be a boolean", "bool_type")])
    caller = service.within(
        caller_of(scope), arguments.pop("namespace", None), headers.get(namespaces.HEADER)
    )
    options = None
    try:
        if kind == "contribution":
            # The gate's options, taken out so that they are not read as the trace's fields.
            asked = {name: arguments.pop(name) for name in _OPTIONS if name in arguments}
            options = ContributionOptions.model_validate(asked)
        traces = (
            BatchIn.model_validate(arguments).traces
            if kind == "batch"
            else [ReasoningTrace.model_validate(arguments)]
        )
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        raise invalid(problems_of(errors)) from None
    declared = headers.get("content-length", "")
    scoring = Scoring(
        caller,
        kind,
        traces,
        arguments["traces"] if kind == "batch" else [arguments],
        dry_run=dry_run,
        body_bytes=int(declared) if declared.isdigit() else None,
        options=options,
    )
    answer = (await service.score(scoring)).model
    assert answer is not None  # no replay: MCP calls carry no Idempotency-Key
    return answer


def session_manager(service: ScoringService) -> StreamableHTTPSessionManager:
    """The MCP server and its streamable-HTTP session manager, for one run of the app (run by
    app.api.mcp.McpHost: the manager runs a task group for the requests)."""
    server: Server[Any] = Server(
        "kp-scoring",
        version=VERSION,
        title="KnowledgePulse trace scoring",
        instructions=(
            f"Call {SCORE_TRACE} with a ReasoningTrace before contributing it: a score of "
            f"{SHARE_THRESHOLD} or more is worth sharing."
        ),
        on_list_tools=_list_tools,
        on_call_tool=functools.partial(_call_tool, service),
    )
    return StreamableHTTPSessionManager(
        server,
        json_response=True,
        stateless=True,
        # The REST API does not check Host or Origin either; a deployment behind a proxy
        # sees its own host names.
        security_settings=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        max_request_body_size=service.settings.max_body_bytes,
    )
