"""The one door: every rule a request meets, whichever transport brought it
(docs/decisions/one-door.md). A scoring request meets every refusal first, then the memory
(its one commit), then its answer, which can no longer fail: nothing is committed before the
last refusal.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from opentelemetry.trace import Tracer
from pydantic import BaseModel, TypeAdapter

from app.contribution.capture import FieldRisk, Finding, Gate, prepare
from app.contribution.js_json import js_value
from app.core import namespaces
from app.core.config import Settings
from app.core.errors import Problem, ServiceError, invalid
from app.core.health import Health
from app.core.metrics import Metrics
from app.core.signatures import UNSIGNED_FIELDS, contribution_claims, trace_digests
from app.embedding.types import OverloadedError
from app.guards.api_keys import ApiKey, KeyRing
from app.guards.api_keys import Scope as KeyScope
from app.guards.idempotency import (
    IdempotencyUnavailableError,
    Recorded,
    fingerprint,
    parse_key,
    scoped_key,
)
from app.guards.rate_limit import RateLimitUnavailableError, retry_after
from app.memory.base import NamespaceLimitError
from app.schemas.contribution import (
    ContributionOptions,
    ContributionOut,
    FieldRiskOut,
    FindingOut,
    GateOptions,
    InjectionOut,
)
from app.schemas.limits import limit_problems, lone_surrogate
from app.schemas.responses import (
    BatchOut,
    CacheBackendOut,
    CacheOut,
    ClearedOut,
    DimensionsOut,
    EmbedderOut,
    EvaluationOut,
    ImportedOut,
    JwksOut,
    NamespacesOut,
    NoveltyOut,
    ProfileOut,
    ReadyOut,
    SnapshotOut,
    StorageOut,
    WeightsOut,
    rounded,
)
from app.schemas.trace import ReasoningTrace
from app.service.cache_transfer import export_lines, read_body
from app.service.evaluator import Evaluation
from app.service.runtime import Runtime

if TYPE_CHECKING:  # joserfc loads only when something is signed
    from app.service.signing import Signer

log = logging.getLogger("app")

Transport = Literal["rest", "mcp"]
#: One trace, a batch (in order, as one step), or one trace with what contributing would send.
Kind = Literal["one", "batch", "contribution"]

#: Where an API key is refused: the header that carries it.
_KEY_LOC = ("header", "authorization")
_IDEMPOTENCY_LOC = ("header", "idempotency-key")
_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="kp-scoring"'}
#: Past this body size the gate's text work runs off the event loop.
INLINE_BODY_BYTES = 64 * 1024
NDJSON_TYPES = ("application/x-ndjson", "application/jsonl")


@dataclass(frozen=True, slots=True)
class Caller:
    """Who asks, and in which namespace: settled before the body is read."""

    key: ApiKey | None
    namespace: str
    transport: Transport = "rest"


@dataclass(frozen=True, slots=True)
class Replay:
    """What makes a request's retry recognisable: its Idempotency-Key as sent, and what the
    request was (method, path, query, body)."""

    key: str
    method: str
    path: str
    query: bytes
    body: bytes


@dataclass(frozen=True, slots=True)
class Scoring:
    """One scoring request. `traces`: validated; `sent`: the same traces as the agent sent
    them (parsed JSON: their digests are signed, the gate reads them); `body_bytes`: the
    request body's size, when known."""

    caller: Caller
    kind: Kind
    traces: Sequence[ReasoningTrace]
    sent: Sequence[Any]
    dry_run: bool = False
    body_bytes: int | None = None
    replay: Replay | None = None
    #: A contribution's: what it asks of the gate beyond the settings.
    options: ContributionOptions | None = None


@dataclass(frozen=True, slots=True)
class Answer:
    """A scoring request's answer: `body`, its JSON as sent (and as replayed byte for byte);
    `model` the answer itself (None for a replay)."""

    body: bytes
    model: BaseModel | None = None
    status: int = 200
    replayed: bool = False


#: What a scoring request settled before the memory: the digests signed, the gate and its
#: options (a contribution's).
_Prepared = tuple[list[str] | None, Gate | None, GateOptions | None]


#: The answers' JSON as FastAPI writes a response model (pydantic's serializer).
_JSON: dict[type[BaseModel], TypeAdapter[Any]] = {
    model: TypeAdapter(model) for model in (EvaluationOut, BatchOut, ContributionOut)
}


class ScoringService:
    """The service's rules over its running parts (`runtime`, app/service/runtime.py)."""

    def __init__(
        self,
        settings: Settings,
        runtime: Runtime,
        metrics: Metrics,
        keys: KeyRing,
        signer: Signer | None,
        tracer: Tracer | None = None,
    ) -> None:
        """`tracer`: when traces are exported (app/main.py), the request's steps as spans."""
        self.settings = settings
        self.tracer = tracer
        self.runtime = runtime
        self.metrics = metrics
        self.keys = keys
        self.signer = signer
        #: Routes served to every caller: no keys file (scoring), no keys and no token (admin).
        self.open: dict[KeyScope, bool] = {
            "evaluate": settings.scoring_open,
            "admin": settings.cache_open,
        }

    # -- who asks: before the body -----------------------------------------------------

    async def admit(
        self,
        scope: KeyScope,
        authorization: Sequence[str],
        namespace: Sequence[str],
        key_in_query: str | None = None,
    ) -> Caller:
        """The caller of a route that needs `scope`, from the request's Authorization and
        KP-Namespace headers and the query parameter a key was sent in, if any: its key
        (checked), its namespace and its first rate-limit token; ServiceError (400, 401, 403,
        422, 429) otherwise."""
        m = self.metrics
        if key_in_query is not None:
            msg = "API keys go in the Authorization header (Bearer), never in the URL"
            raise ServiceError(400, "key_in_query", msg, loc=("query", key_in_query))
        if len(authorization) > 1:
            # Which one a proxy, a log or this service reads first is anyone's guess.
            msg = f"one Authorization header, not {len(authorization)}"
            raise ServiceError(400, "repeated_header", msg, loc=_KEY_LOC)
        presented = None
        if authorization:
            scheme, _, token = authorization[0].strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                presented = token.strip()
        key = None if presented is None else self.keys.identify(presented)
        if self.open[scope]:
            key = key if key is not None and scope in key.scopes else None
        elif key is None:
            reason = "missing" if presented is None else "unknown_key"
            m.child(m.auth_refused, reason).inc()
            what = "an API key" if scope == "evaluate" else "KP_ADMIN_TOKEN or an admin key"
            problem = "is required" if presented is None else "is not valid"
            msg = f"a bearer key {problem}: Authorization: Bearer <{what}>"
            raise ServiceError(401, "unauthorized", msg, loc=_KEY_LOC, headers=_CHALLENGE)
        elif scope not in key.scopes:
            m.child(m.auth_refused, "missing_scope").inc()
            msg = f"the API key {key.name!r} lacks the scope {scope!r}"
            raise ServiceError(403, "forbidden", msg, loc=_KEY_LOC)
        if len(namespace) > 1:
            msg = f"one {namespaces.HEADER} header, not {len(namespace)}"
            raise ServiceError(400, "repeated_header", msg, loc=namespaces.LOC)
        if namespace:
            chosen = self._namespace(key, namespace[0])
        else:
            chosen = namespaces.DEFAULT if key is None or key.namespace is None else key.namespace
        if key is None:
            return Caller(None, chosen)
        if key.rate_per_minute is not None:  # the first token; a batch's others: _charge_batch
            wait = await self._take(key.name, key.rate_per_minute, 1)
            if wait > 0:
                m.child(m.key_requests, key.name, "rate_limited").inc()
                seconds = retry_after(wait)
                msg = (
                    f"the API key {key.name!r} is over its rate of {key.rate_per_minute} "
                    f"requests a minute: retry after {seconds} s"
                )
                raise ServiceError(429, "rate_limited", msg, loc=_KEY_LOC, retry_after=seconds)
        m.child(m.key_requests, key.name, "admitted").inc()
        return Caller(key, chosen)

    def within(self, caller: Caller, argument: object, header: str | None) -> Caller:
        """The caller of an MCP tool: in the namespace its `namespace` argument names (the
        header's rules, the argument standing for it), else the request's."""
        if argument is None:
            return Caller(caller.key, caller.namespace, "mcp")
        if not isinstance(argument, str):
            raise ServiceError(422, "string_type", "should be a string", loc=("namespace",))
        chosen = self._namespace(caller.key, argument, loc=("namespace",), named="")
        if header is not None and header != chosen:
            msg = (
                f"the argument {chosen!r} and the {namespaces.HEADER} header {header!r} "
                "differ; send one, or the same"
            )
            raise ServiceError(403, "namespace_mismatch", msg)
        return Caller(caller.key, chosen, "mcp")

    def _namespace(self, key: ApiKey | None, given: str | None, **where: Any) -> str:
        try:
            return namespaces.resolve(
                given,
                key_name=None if key is None else key.name,
                bound=None if key is None else key.namespace,
                **where,
            )
        except ServiceError as exc:
            if exc.status == 403:
                self.metrics.child(self.metrics.auth_refused, exc.kind).inc()
            raise

    async def _take(self, name: str, rate: int, cost: int) -> float:
        """The key's wait for `cost` tokens; 0 (unchecked, counted and logged) when Redis is
        away: refusing every agent then would be worse."""
        try:
            return await self.runtime.rate_limiter.take(name, rate, cost)
        except RateLimitUnavailableError as exc:
            self.metrics.rate_limit_unavailable.inc()
            log.warning("rate limit not checked: Redis unavailable", extra={"reason": str(exc)})
            return 0.0

    async def _charge_batch(self, key: ApiKey | None, traces: int) -> None:
        """A batch costs one token per trace, as the same traces sent one by one would: the
        first was taken before the body; the others now, before any is scored. A batch refused
        here (422: more traces than the bucket holds; 429: not enough tokens now) spends
        nothing: its first token is given back."""
        if key is None or key.rate_per_minute is None or traces <= 1:
            return
        rate, limiter = key.rate_per_minute, self.runtime.rate_limiter
        if traces > rate:
            msg = (
                f"at most {rate} traces a batch for the API key {key.name!r} (its rate per "
                "minute: a batch costs one token per trace)"
            )
            refusal = ServiceError(422, "batch_over_rate", msg, loc=("body", "traces"))
        else:
            wait = await self._take(key.name, rate, traces - 1)
            if wait <= 0:
                return
            seconds = retry_after(wait)
            msg = (
                f"the API key {key.name!r} is over its rate of {rate} traces a minute (a batch "
                f"of {traces} costs {traces}): retry after {seconds} s"
            )
            refusal = ServiceError(429, "rate_limited", msg, loc=_KEY_LOC, retry_after=seconds)
        # A negative cost adds to the bucket (it clamps at its capacity as it refills). Should
        # the shared buckets have gone away since, the token stays spent: the strict side.
        with contextlib.suppress(RateLimitUnavailableError):
            await limiter.take(key.name, rate, -1)
        raise refusal

    # -- scoring ------------------------------------------------------------------------

    async def score(self, request: Scoring) -> Answer:
        """Scores the request's traces in its caller's namespace: its answer, or ServiceError
        (having changed nothing)."""
        m = self.metrics
        kind = "batch" if request.kind == "batch" else "one"
        m.child(m.scoring_requests, request.caller.transport, kind).inc()
        if request.replay is not None:
            return await self._once(request, request.replay)
        return await self._score(request)

    async def _score(self, request: Scoring, receipt: str | None = None) -> Answer:
        tracer = self.tracer
        if tracer is None:
            prepared = await self._refusals(request)
            evaluations = await self._evaluate(request, receipt)
            return self._answer(request, prepared, evaluations)
        with tracer.start_as_current_span("kp.score") as span:
            with tracer.start_as_current_span("kp.validation"):
                prepared = await self._refusals(request)
            evaluations = await self._evaluate(request, receipt)
            signing = self.signer is not None
            with tracer.start_as_current_span("kp.sign") if signing else contextlib.nullcontext():
                answer = self._answer(request, prepared, evaluations)
            # What an operator follows a request by: the traces, the namespace, the tokens
            # read and what novelty came to.
            first = evaluations[0].novelty
            span.set_attributes(
                {
                    "kp.namespace": request.caller.namespace,
                    "kp.transport": request.caller.transport,
                    "kp.kind": request.kind,
                    "kp.traces": len(evaluations),
                    "kp.trace_id": [e.trace_id for e in evaluations],
                    "kp.tokens": [e.novelty.tokens or 0 for e in evaluations],
                    "kp.novelty.measured": first.measured,
                    "kp.novelty.reason": first.reason or "",
                    "kp.novelty.stored": first.stored,
                    "kp.score": [e.score.value for e in evaluations],
                    "kp.dry_run": request.dry_run,
                }
            )
        return answer

    async def _refusals(self, request: Scoring) -> _Prepared:
        """Every check that can refuse the request, before the memory is touched."""
        batch = request.kind == "batch"
        problems = limit_problems(
            request.sent, self.settings, batch=batch, body_bytes=request.body_bytes
        )
        if problems:
            raise invalid(problems)
        digests: list[str] | None = None
        gate: Gate | None = None
        options: GateOptions | None = None
        if request.kind == "contribution":
            (given,) = request.sent
            where = lone_surrogate(given)
            if where is not None:
                msg = (
                    "holds a lone surrogate (a \\ud800-\\udfff escape without its pair): not "
                    "UTF-8 text"
                )
                raise invalid([Problem(("body", *where), msg, "lone_surrogate")])
            at = ("query",) if request.caller.transport == "rest" else ()
            asked = request.options or ContributionOptions()
            options = asked.resolve(self.settings, at)
            # What the SDK's capture would send (its score set once scored) and what it would
            # leak; a large trace's text work off the event loop.
            work = functools.partial(
                prepare,
                given,
                clean_all=self.settings.contribution_clean_all,
                redact_suspected=options.redact_suspected,
                suspicious_threshold=options.suspicious_threshold,
                reject_threshold=options.reject_threshold,
            )
            big = request.body_bytes is not None and request.body_bytes > INLINE_BODY_BYTES
            gate = await asyncio.to_thread(work) if big else work()
        if self.signer is not None:
            digests = trace_digests(request.sent, batch=batch, at=("body",))
        if batch:
            await self._charge_batch(request.caller.key, len(request.traces))
        return digests, gate, options

    async def _evaluate(self, request: Scoring, receipt: str | None) -> list[Evaluation]:
        """The one commit: the traces meet their namespace's memory in order; under an
        Idempotency-Key its `receipt` is kept with it (a retry whose answer a crash lost gets
        the same comparisons, and adds nothing)."""
        m, caller = self.metrics, request.caller
        try:
            evaluations = await self.runtime.evaluator.evaluate(
                request.traces,
                dry_run=request.dry_run,
                namespace=caller.namespace,
                receipt=receipt,
            )
        except OverloadedError as exc:
            m.child(m.overloaded, exc.reason).inc()
            raise
        except NamespaceLimitError:
            m.namespace_limit.inc()
            raise
        m.child(m.namespace_evaluations, m.namespace_label(caller.namespace)).inc(len(evaluations))
        for e in evaluations:
            m.child(m.evaluations, e.score.weights.name).inc()
            m.score.observe(e.score.value)
            for rule in e.score.overrides:
                m.child(m.overrides, rule).inc()
            if not e.novelty.measured and e.novelty.reason is not None:
                m.child(m.novelty_unmeasured, e.novelty.reason).inc()
            if e.novelty.search is not None:
                m.child(m.novelty_search, e.novelty.search).inc()
        return evaluations

    def _answer(
        self, request: Scoring, prepared: _Prepared, evaluations: list[Evaluation]
    ) -> Answer:
        signed, gate, options = prepared
        digests: Sequence[str | None] = signed or [None] * len(evaluations)
        if request.kind == "contribution":
            assert gate is not None
            assert options is not None
            (evaluation,) = evaluations
            model: BaseModel = self._contribution_out(
                evaluation, gate, options, digests[0], dry_run=request.dry_run
            )
        elif request.kind == "batch":
            answers = []
            for e, digest in zip(evaluations, digests, strict=True):
                answers.append(self._evaluation_out(e, digest, dry_run=request.dry_run))
            model = BatchOut(results=answers)
        else:
            model = self._evaluation_out(evaluations[0], digests[0], dry_run=request.dry_run)
        return Answer(_JSON[type(model)].dump_json(model), model)

    def _evaluation_out(
        self,
        evaluation: Evaluation,
        digest: str | None,
        *,
        dry_run: bool,
        claims: Mapping[str, Any] | None = None,
    ) -> EvaluationOut:
        """The answer for one evaluation; signed (with a signer and the trace's `digest`):
        every field it shows, the trace's digest and a route's own `claims`."""
        s, n, w = evaluation.score, evaluation.novelty, evaluation.score.weights
        out = EvaluationOut(
            trace_id=evaluation.trace_id,
            score=s.value,
            dimensions=DimensionsOut.model_validate(s.dimensions, from_attributes=True),
            weights=WeightsOut(
                profile=w.name,
                complexity=w.complexity,
                novelty=w.novelty,
                tool_diversity=w.tool_diversity,
                outcome_confidence=w.outcome_confidence,
            ),
            profile=ProfileOut(name=w.name, domain_recognised=s.domain_recognised),
            overrides=list(s.overrides),
            novelty=NoveltyOut.model_validate(n, from_attributes=True),
            elapsed_ms=round(evaluation.elapsed_ms, 3),
        )
        if self.signer is not None and digest is not None:
            shown = out.model_dump(mode="json", exclude=set(UNSIGNED_FIELDS))
            out.signature = self.signer.sign(shown, digest, dry_run=dry_run, claims=claims)
        return out

    def _contribution_out(
        self,
        evaluation: Evaluation,
        gate: Gate,
        options: GateOptions,
        digest: str | None,
        *,
        dry_run: bool,
    ) -> ContributionOut:
        score = rounded(evaluation.score.value)  # as the answer shows it
        metadata = gate.contribution.get("metadata")
        if isinstance(metadata, dict):  # the capture step sets the score it computed
            metadata["quality_score"] = js_value(score)
        threshold = self.settings.contribution_threshold
        answer = ContributionOut(
            evaluation=self._evaluation_out(evaluation, None, dry_run=dry_run),
            shareable=score >= threshold,
            threshold=threshold,
            leaks_remain=gate.leaks_remain,
            differs_from_sdk=gate.differs_from_sdk,
            contribution=gate.contribution,
            redactions=[_finding(f) for f in gate.redactions],
            uncleaned=[_finding(f) for f in gate.uncleaned],
            inputs_kept=list(gate.inputs_kept),
            findings=[_finding(f) for f in gate.findings],
            injection=InjectionOut(
                fields=[_risk(f) for f in gate.injection],
                highest=None if gate.highest is None else _risk(gate.highest),
                suspicious_threshold=options.suspicious_threshold,
                reject_threshold=options.reject_threshold,
            ),
        )
        if self.signer is not None and digest is not None:
            # The whole answer is signed: the evaluation as /evaluate's, the cleaned trace by
            # its digest (a registry sent it checks it is the one scored and cleaned here),
            # every other field as the API shows it.
            shown = answer.model_dump(mode="json", exclude={"evaluation", "contribution"})
            claims = contribution_claims(shown, gate.contribution)
            answer.evaluation = self._evaluation_out(
                evaluation, digest, dry_run=dry_run, claims=claims
            )
        return answer

    # -- idempotency --------------------------------------------------------------------

    async def _once(self, request: Scoring, replay: Replay) -> Answer:
        """The request scored once for its Idempotency-Key (docs/decisions/idempotency-key.md),
        the key its receipt for the memory: a retry after a crash lost both the answer and its
        record (in this process) still finds the first commit's comparisons there."""
        caller = request.caller
        key = parse_key(replay.key)
        if key is None:
            msg = "must be 1 to 255 visible ASCII characters"
            raise ServiceError(400, "idempotency_key_invalid", msg, loc=_IDEMPOTENCY_LOC)
        records = self.runtime.idempotency
        scoped = scoped_key(None if caller.key is None else caller.key.name, caller.namespace, key)
        print_ = fingerprint(replay.method, replay.path, replay.query, replay.body)
        try:
            decision = await records.begin(scoped, print_)
        except IdempotencyUnavailableError as exc:
            log.error("idempotency records unavailable", extra={"reason": str(exc)})
            msg = "idempotency records are unavailable (Redis): nothing was scored, retry"
            raise ServiceError(
                503, "idempotency_unavailable", msg, loc=_IDEMPOTENCY_LOC, retry_after=1
            ) from None
        self.metrics.child(self.metrics.idempotency, decision.action).inc()
        if decision.action == "mismatch":
            msg = "this Idempotency-Key was used for another request (body or query)"
            raise ServiceError(422, "idempotency_key_reused", msg, loc=_IDEMPOTENCY_LOC)
        if decision.action == "in_progress":
            msg = "a request with this Idempotency-Key is still being answered: retry later"
            raise ServiceError(
                409, "idempotency_key_in_use", msg, loc=_IDEMPOTENCY_LOC, retry_after=1
            )
        if decision.action == "replay":
            assert decision.recorded is not None
            return Answer(decision.recorded.body, status=decision.recorded.status, replayed=True)
        answer = None
        try:
            answer = await self._score(request, scoped)
            return answer
        finally:
            recorded = None if answer is None else Recorded(200, b"application/json", answer.body)
            try:
                await records.finish(scoped, print_, recorded)
            except IdempotencyUnavailableError as exc:
                # The answer goes out: a retry will be scored again (and say it in the log).
                log.error("idempotency record not kept", extra={"reason": str(exc)})

    # -- the memory, for operators --------------------------------------------------------

    async def cache_stats(self, caller: Caller) -> CacheOut:
        memory = self.runtime.memory
        stats = await memory.stats(caller.namespace)
        return CacheOut(
            namespace=caller.namespace,
            **asdict(stats),
            embedder=self.embedder_out(),
            backend=CacheBackendOut(**asdict(memory.backend)),
        )

    async def cache_clear(self, caller: Caller) -> ClearedOut:
        cleared = await self.runtime.memory.clear(caller.namespace)
        log.info("cache cleared", extra={"cleared": cleared, "namespace": caller.namespace})
        return ClearedOut(cleared=cleared)

    async def cache_export(self, caller: Caller) -> AsyncIterator[bytes]:
        """NDJSON lines, oldest first. The first chunk is read before this returns: an
        unreachable memory is a refusal (503), not a truncated answer."""
        chunks = self.runtime.memory.export_chunks(caller.namespace)
        first = await anext(chunks, None)

        async def lines() -> AsyncIterator[bytes]:
            chunk = first
            while chunk is not None:
                for line in export_lines([chunk]):
                    yield line
                chunk = await anext(chunks, None)

        return lines()

    async def cache_import(
        self, caller: Caller, content_type: str | None, body: AsyncIterator[bytes]
    ) -> ImportedOut:
        """Appends exported lines as the namespace's newest, all or nothing."""
        given = (content_type or "").split(";")[0].strip().lower()
        if given not in NDJSON_TYPES:
            msg = f"must be {NDJSON_TYPES[0]}, got {given or 'none'!r}"
            raise ServiceError(415, "unsupported_media_type", msg, loc=("header", "content-type"))
        memory = self.runtime.memory
        limit = self.settings.cache_import_max_bytes
        entries, lines = await read_body(body, memory.dimensions, limit)
        try:
            imported, expired = await memory.import_entries(caller.namespace, entries)
        except NamespaceLimitError:
            self.metrics.namespace_limit.inc()
            raise
        log.info(
            "cache imported",
            extra={"imported": imported, "expired": expired, "namespace": caller.namespace},
        )
        return ImportedOut(imported=imported, expired=expired, lines=lines)

    async def namespaces(self, caller: Caller) -> NamespacesOut:
        key = caller.key
        if key is not None and key.namespace is not None:
            self.metrics.child(self.metrics.auth_refused, "namespace_forbidden").inc()
            msg = (
                f"the API key {key.name!r} is bound to the namespace {key.namespace!r}: listing "
                "every namespace needs KP_ADMIN_TOKEN or an admin key bound to none"
            )
            raise ServiceError(403, "namespace_forbidden", msg, loc=_KEY_LOC)
        found = await self.runtime.memory.namespaces()
        return NamespacesOut(namespaces=found, limit=self.settings.max_namespaces)

    # -- what the service says of itself ----------------------------------------------------

    def embedder_out(self) -> EmbedderOut:
        e = self.runtime.embeddings
        return EmbedderOut(
            state=e.state,
            model=e.model_name,
            weights=e.weights,
            precision=e.precision,
            precision_reason=e.precision_reason,
            reason=e.reason,
        )

    def ready(self, *others: Health) -> ReadyOut:
        """Readiness: every part's report, and `others` (a transport's own)."""
        runtime = self.runtime
        health = runtime.health()
        status = runtime.storage_status()
        storage = StorageOut(
            **{**asdict(status), "path": str(status.path) if status.path else None}
        )
        return ReadyOut(
            status="degraded" if health.degraded else "ready",
            degraded=health.degraded,
            embedder=self.embedder_out(),
            cache_size=runtime.memory.size,
            cache_backend=CacheBackendOut(**asdict(runtime.memory.backend)),
            admin_auth=not self.settings.cache_open,
            storage=storage,
            snapshot=SnapshotOut(
                **{_SNAPSHOT_NAMES.get(k, k): v for k, v in storage.model_dump().items()}
            ),
            warnings=[*health.warnings, *(w for other in others for w in other.warnings)],
        )

    def jwks(self) -> JwksOut:
        signer = self.signer
        return JwksOut.model_validate(signer.jwks() if signer is not None else {"keys": []})


def _finding(finding: Finding) -> FindingOut:
    return FindingOut.model_validate(finding, from_attributes=True)


def _risk(field: FieldRisk) -> FieldRiskOut:
    return FieldRiskOut(path=field.path, **asdict(field.assessment))


#: `snapshot`'s names for `storage`'s fields (deprecated; removed in the next release).
_SNAPSHOT_NAMES = {
    "last_commit_at_ms": "last_saved_at_ms",
    "last_write_error": "last_save_error",
    "commits_total": "saves_total",
    "write_errors_total": "save_errors_total",
}
