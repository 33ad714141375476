"""The MCP server behind /mcp (streamable HTTP), for agents that speak MCP (app/api/mcp.py
loads this module on the first /mcp request: the MCP SDK takes longer to import than the rest
of the service, and most starts never serve MCP).

Built on the official MCP Python SDK's low-level server, in the same app and process as the
REST API: the tools call the same scoring function the routes call (one memory, one queue,
the same limits and metrics). The server is stateless and answers in JSON, so any replica can
answer any request (no session to pin to one process) and nothing is held between requests.

The tools' input schemas are the JSON Schemas of the models that validate POST /evaluate and
POST /evaluate/batch (the trace's own fields at the top, plus `dry_run` and `namespace`), and
their output schemas those of the REST answers: an agent sends the trace it would POST and gets
the answer the REST API would give. The namespace is the `namespace` argument, else the MCP
request's KP-Namespace header, else the API key's, else `default` (docs/api.md, namespaces).
"""

from __future__ import annotations

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

from app.api.asgi.namespaces import namespace_of
from app.api.batch_cost import charge_batch
from app.api.deps import Services
from app.api.presenters import evaluation_out
from app.api.routes.contribution import (
    INLINE_BODY_BYTES,
    contribution_answer,
    lone_surrogate_errors,
)
from app.core import namespaces
from app.core.metrics import Metrics
from app.core.signatures import unsignable_errors
from app.core.version import VERSION
from app.embedding.embeddings import OverloadedError
from app.guards.api_keys import ApiKey
from app.memory.base import NamespaceLimitError
from app.schemas.contribution import ContributionOptions, ContributionOut, GateOptions
from app.schemas.ids import visible
from app.schemas.limits import sent_string_errors
from app.schemas.responses import BatchIn, BatchOut, EvaluationOut
from app.schemas.trace import ReasoningTrace
from app.service.scoring_requests import TraceLimitError, score_traces

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


def _input_schema(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema(by_alias=True)
    schema["properties"] = {
        **schema["properties"],
        "dry_run": _DRY_RUN_SCHEMA,
        "namespace": _NAMESPACE_SCHEMA,
    }
    return schema


#: kp_check_contribution's arguments beyond the trace's (POST /contribution's query).
_OPTIONS: Final = tuple(ContributionOptions.model_fields)


def _contribution_input_schema() -> dict[str, Any]:
    schema = _input_schema(ReasoningTrace)
    options = ContributionOptions.model_json_schema()["properties"]
    schema["properties"] = {**schema["properties"], **options}
    return schema


def _contribution_options(
    arguments: dict[str, Any], services: Services
) -> GateOptions | types.CallToolResult:
    """The gate's options taken out of the arguments (so that they are not read as the
    trace's), or the tool error refusing them."""
    asked = {name: arguments.pop(name) for name in _OPTIONS if name in arguments}
    try:
        options = ContributionOptions.model_validate(asked).resolve(services.settings)
    except ValidationError as exc:
        return _invalid(exc.errors(include_url=False, include_input=False))
    return _invalid(options) if isinstance(options, list) else options


def _tools() -> list[types.Tool]:
    # Not read-only: without dry_run the trace joins the novelty cache; nothing is deleted.
    annotations = types.ToolAnnotations(read_only_hint=False, destructive_hint=False)
    return [
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
            annotations=annotations,
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
            annotations=annotations,
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
            input_schema=_contribution_input_schema(),
            output_schema=ContributionOut.model_json_schema(),
            annotations=annotations,
        ),
    ]


def _field(loc: Sequence[str | int]) -> str:
    path = [str(part) for part in loc]
    if path[:1] == ["body"]:  # the limit errors name fields as REST body fields
        path = path[1:]
    return ".".join(path) or "(arguments)"


def _scope(ctx: Any) -> dict[str, Any]:
    """The HTTP request's scope, as the request pipeline left it."""
    scope: dict[str, Any] = getattr(getattr(ctx, "request", None), "scope", None) or {}
    return scope


def _api_key(ctx: Any) -> ApiKey | None:
    """The caller's key, as the API-key middleware left it in the HTTP request's scope."""
    key = _scope(ctx).get("state", {}).get("api_key")
    return key if isinstance(key, ApiKey) else None


def _namespace(ctx: Any, argument: object, metrics: Metrics) -> str | types.CallToolResult:
    """The call's namespace (the argument, else the request's), or the tool error refusing it;
    the rules are the header's, the argument standing for it."""
    scope = _scope(ctx)
    if argument is None:
        return namespace_of(scope)
    if not isinstance(argument, str):
        not_str = {"loc": ["namespace"], "msg": "should be a string", "type": "string_type"}
        return _invalid([not_str])
    key = _api_key(ctx)
    try:
        chosen = namespaces.resolve(
            argument,
            key_name=None if key is None else key.name,
            bound=None if key is None else key.namespace,
        )
    except namespaces.NamespaceRefusedError as exc:
        message = str(exc).replace(f"{namespaces.HEADER} must", "must")
        if exc.status == 422:
            return _invalid([{"loc": ["namespace"], "msg": message, "type": exc.kind}])
        metrics.child(metrics.auth_refused, exc.kind).inc()
        return _tool_error(f"namespace refused, nothing was scored: {visible(message)}")
    header = Headers(scope=scope).get(namespaces.HEADER) if scope else None
    if header is not None and header != chosen:
        return _tool_error(
            f"namespace refused, nothing was scored: the argument {chosen!r} and the "
            f"{namespaces.HEADER} header {visible(header)!r} differ; send one, or the same"
        )
    return chosen


def _body_bytes(ctx: Any) -> int:
    """The HTTP request's declared body size (0 when unknown)."""
    scope = getattr(getattr(ctx, "request", None), "scope", None) or {}
    for name, value in scope.get("headers", ()):
        if name == b"content-length" and value.isdigit():
            return int(value)
    return 0


def _tool_error(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=text)], is_error=True)


def _invalid(errors: Sequence[Any]) -> types.CallToolResult:
    # Field paths and messages only: like the REST 422, never the input itself.
    # Escaped: a path may name a key of the caller's own JSON (limit errors do).
    fields = visible("; ".join(f"{_field(e['loc'])}: {e['msg']} ({e['type']})" for e in errors))
    return _tool_error(f"invalid arguments, nothing was scored: {fields}")


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


class McpTools:
    """The tools, over the running app's services."""

    def __init__(self, services: Services) -> None:
        self.services = services

    async def list_tools(
        self, ctx: Any, params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=_TOOLS)

    async def call_tool(
        self, ctx: Any, params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        try:
            return await self._call(ctx, params)
        except MCPError:
            raise
        except Exception:
            # As the REST API's 500: logged here, no internals in the answer.
            log.exception("mcp: unhandled error", extra={"tool": params.name})
            raise MCPError(types.INTERNAL_ERROR, "internal error") from None

    async def _call(self, ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        if params.name not in (SCORE_TRACE, SCORE_TRACES, CHECK_CONTRIBUTION):
            raise MCPError(types.INVALID_PARAMS, f"unknown tool: {params.name}")
        arguments = dict(params.arguments or {})
        dry_run = arguments.pop("dry_run", False)
        if not isinstance(dry_run, bool):
            not_bool = {"loc": ["dry_run"], "msg": "should be a boolean", "type": "bool_type"}
            return _invalid([not_bool])
        namespace = _namespace(ctx, arguments.pop("namespace", None), self.services.metrics)
        if isinstance(namespace, types.CallToolResult):
            return namespace
        batch = params.name == SCORE_TRACES
        contributing = params.name == CHECK_CONTRIBUTION
        options = _contribution_options(arguments, self.services) if contributing else None
        if isinstance(options, types.CallToolResult):
            return options
        try:
            traces = (
                BatchIn.model_validate(arguments).traces
                if batch
                else [ReasoningTrace.model_validate(arguments)]
            )
        except ValidationError as exc:
            return _invalid(exc.errors(include_url=False, include_input=False))
        if batch:
            refused = await charge_batch(self.services.rate_limiter, _api_key(ctx), len(traces), ())
            if refused is not None:
                return _tool_error(f"nothing was scored: {refused.error['msg']}")
        sent = arguments["traces"] if batch else [arguments]
        unsignable = unsignable_errors(sent, batch=batch) if self.services.signer else []
        if unsignable:
            return _invalid(unsignable)
        given = (
            lone_surrogate_errors(arguments, ())
            or sent_string_errors(
                arguments,
                self.services.settings.max_string_chars,
                at=(),
                body_bytes=_body_bytes(ctx) or None,
            )
            if contributing
            else []
        )
        if given:
            return _invalid(given)
        s = self.services
        try:
            evaluations = await score_traces(
                s.evaluator,
                s.limits,
                s.metrics,
                traces,
                dry_run=dry_run,
                batch=batch,
                transport="mcp",
                namespace=namespace,
            )
        except TraceLimitError as exc:
            return _invalid(exc.errors)
        except OverloadedError as exc:
            return _tool_error(f"overloaded, nothing was scored; retry in a second: {exc}")
        except NamespaceLimitError as exc:
            s.metrics.namespace_limit.inc()
            return _tool_error(f"namespace refused, nothing was scored: {exc}")
        if contributing:
            (evaluation,) = evaluations
            large = _body_bytes(ctx) > INLINE_BODY_BYTES
            answer = await contribution_answer(
                s,
                evaluation,
                arguments,
                signed=True,
                dry_run=dry_run,
                large=large,
                options=options,
            )
            return types.CallToolResult(
                content=[types.TextContent(text=contribution_summary(answer))],
                structured_content=answer.model_dump(mode="json"),
            )
        answers = [
            evaluation_out(e, s.signer, trace, dry_run=dry_run)
            for e, trace in zip(evaluations, sent, strict=True)
        ]
        return _result(answers, batch=batch)


def _result(answers: list[EvaluationOut], *, batch: bool) -> types.CallToolResult:
    if batch:
        structured = BatchOut(results=answers).model_dump(mode="json")
        text = "\n".join(f"{visible(a.trace_id)}: {summary(a)}" for a in answers)
    else:
        (answer,) = answers
        structured = answer.model_dump(mode="json")
        text = summary(answer)
    return types.CallToolResult(
        content=[types.TextContent(text=text)], structured_content=structured
    )


_TOOLS: Final = _tools()


class McpTransport:
    """The MCP server and its streamable-HTTP session manager, for one run of the app (run by
    app.api.mcp.McpHost: the manager runs a task group for the requests)."""

    def __init__(self, services: Services) -> None:
        tools = McpTools(services)
        server: Server[Any] = Server(
            "kp-scoring",
            version=VERSION,
            title="KnowledgePulse trace scoring",
            instructions=(
                f"Call {SCORE_TRACE} with a ReasoningTrace before contributing it: a score of "
                f"{SHARE_THRESHOLD} or more is worth sharing."
            ),
            on_list_tools=tools.list_tools,
            on_call_tool=tools.call_tool,
        )
        self.manager = StreamableHTTPSessionManager(
            server,
            json_response=True,
            stateless=True,
            # The REST API does not check Host or Origin either; a deployment behind a proxy
            # sees its own host names.
            security_settings=TransportSecuritySettings(enable_dns_rebinding_protection=False),
            max_request_body_size=services.settings.max_body_bytes,
        )
