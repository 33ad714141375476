"""A typed Python client for the kp-scoring service, sync and async, on httpx.

    from kp_scoring import KpScoringClient

    with KpScoringClient("http://127.0.0.1:8000") as kp:
        result = kp.evaluate(trace)          # a dict (parsed JSON) or a pydantic model
        print(result.score, result.dimensions.novelty)
        if result.novelty.nearest:           # the stored trace it resembles most
            print(result.novelty.nearest.trace_id, result.novelty.nearest.age_ms)

Every failure is a `KpScoringError`: `Unreachable` (no answer), `ValidationFailed` (422, with
the field paths), `Unauthorized` (401), `Forbidden` (403), `RateLimited` (429, with
`retry_after`), `Overloaded` (503, with `retry_after`), or the base class for any other error
status. `RateLimited` and `Overloaded` are both a `TryLater`: nothing was done, the same request
may succeed later; with `retries=N` the client itself waits the answer's Retry-After (at most
`max_retry_wait` seconds) and tries again, up to N times. `api_key` (default: the KP_API_KEY
variable) is sent with every scoring request. `namespace` (default: the KP_NAMESPACE variable,
else none: the key's namespace or `default`) names the memory every request acts on, as the
`KP-Namespace` header; a method's own `namespace=` overrides it for that call.
`verify_signature` checks a signed score against the trace and the service's JWKS.

Error messages hold text the service sent: they are made printable (`kp_scoring.text.visible`).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import httpx
from pydantic import BaseModel

from kp_scoring.models import (
    BatchOut,
    CacheOut,
    ClearedOut,
    ContributionOut,
    EvaluationOut,
    NamespacesOut,
    ReadyOut,
)
from kp_scoring.signatures import DEFAULT_LEEWAY_S, SignatureInvalidError, trace_sha256, verify
from kp_scoring.text import visible

#: Checks a signed score: its claims, or SignatureInvalidError (kp_scoring.signatures).
verify_signature = verify

__all__ = [
    "AsyncKpScoringClient",
    "FieldError",
    "Forbidden",
    "KpScoringClient",
    "KpScoringError",
    "Overloaded",
    "RateLimited",
    "SignatureInvalidError",
    "TraceLike",
    "TryLater",
    "Unauthorized",
    "Unreachable",
    "ValidationFailed",
    "trace_sha256",
    "verify_signature",
]

DEFAULT_URL = "http://127.0.0.1:8000"
#: The header that names a request's namespace (its memory).
NAMESPACE_HEADER = "KP-Namespace"

#: A trace as parsed JSON (a dict), or any pydantic model of one (dumped by alias, without
#: the fields left unset as None).
TraceLike = Mapping[str, Any] | BaseModel

#: Without a Retry-After, a retry waits this long (seconds).
DEFAULT_RETRY_WAIT = 1.0


@dataclass(frozen=True, slots=True)
class FieldError:
    """One problem the service found in a request, e.g. `body.steps.0.type`."""

    loc: tuple[str | int, ...]
    msg: str
    type: str

    @property
    def path(self) -> str:
        return ".".join(str(part) for part in self.loc)

    def __str__(self) -> str:
        return visible(f"{self.path}: {self.msg}")


class KpScoringError(Exception):
    """The service could not be reached, or answered with an error status."""

    def __init__(self, message: str, *, status_code: int | None = None, detail: Any = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.detail = detail

    @property
    def errors(self) -> list[FieldError]:
        """The field errors of a `{"detail": [{"loc", "msg", "type"}]}` answer, else []."""
        return _field_errors(self.detail)


class Unreachable(KpScoringError):  # noqa: N818 (names say what happened)
    """No HTTP answer: connection refused, DNS failure, timeout."""


class ValidationFailed(KpScoringError):  # noqa: N818
    """422: the trace (or the request) is invalid; `errors` lists the field paths."""


class Unauthorized(KpScoringError):  # noqa: N818
    """401: the API key or admin token is missing or unknown."""


class Forbidden(KpScoringError):  # noqa: N818
    """403: the API key lacks the scope the request needs, or is bound to another namespace."""


class TryLater(KpScoringError):  # noqa: N818
    """429 or 503: nothing was done and the same request may succeed later, after
    `retry_after` seconds (the answer's Retry-After; None when it gave none)."""

    def __init__(
        self, message: str, *, status_code: int, retry_after: float | None, detail: Any = None
    ) -> None:
        super().__init__(message, status_code=status_code, detail=detail)
        self.retry_after = retry_after


class RateLimited(TryLater):
    """429: the API key is over its rate; nothing was scored; retry after `retry_after` s."""

    def __init__(self, message: str, *, retry_after: float | None, detail: Any = None) -> None:
        super().__init__(message, status_code=429, retry_after=retry_after, detail=detail)


class Overloaded(TryLater):
    """503: the service is busy; try again after `retry_after` seconds."""

    def __init__(self, message: str, *, retry_after: float | None, detail: Any = None) -> None:
        super().__init__(message, status_code=503, retry_after=retry_after, detail=detail)


def _field_errors(detail: Any) -> list[FieldError]:
    if not isinstance(detail, list):
        return []
    return [
        FieldError(tuple(e.get("loc", ())), str(e.get("msg", "")), str(e.get("type", "")))
        for e in detail
        if isinstance(e, dict)
    ]


def _trace_json(trace: TraceLike) -> dict[str, Any]:
    if isinstance(trace, BaseModel):
        return trace.model_dump(mode="json", by_alias=True, exclude_none=True)
    return dict(trace)


def _params(dry_run: bool) -> dict[str, str]:
    return {"dry_run": "true"} if dry_run else {}


def _contribution_params(
    dry_run: bool,
    redact_suspected: bool | None,
    suspicious_threshold: float | None,
    reject_threshold: float | None,
) -> dict[str, str]:
    params = _params(dry_run)
    if redact_suspected is not None:
        params["redact_suspected"] = "true" if redact_suspected else "false"
    for name, value in (
        ("suspicious_threshold", suspicious_threshold),
        ("reject_threshold", reject_threshold),
    ):
        if value is not None:
            params[name] = repr(float(value))
    return params


def _check(response: httpx.Response) -> Any:
    """The JSON body of a successful answer, or the matching KpScoringError."""
    try:
        body: Any = response.json()
    except ValueError:
        body = None
    if response.is_success:
        return body
    status = response.status_code
    detail = body.get("detail") if isinstance(body, dict) else response.text or None
    if isinstance(detail, list):
        text = "; ".join(str(e) for e in _field_errors(detail))
    else:
        text = visible(detail) if detail else response.reason_phrase
    message = f"{status} {visible(response.reason_phrase)}: {text}"
    if status == 422:
        raise ValidationFailed(message, status_code=status, detail=detail)
    if status == 401:
        raise Unauthorized(message, status_code=status, detail=detail)
    if status == 403:
        raise Forbidden(message, status_code=status, detail=detail)
    if status == 429:
        raise RateLimited(message, retry_after=_retry_after(response), detail=detail)
    if status == 503:
        raise Overloaded(message, retry_after=_retry_after(response), detail=detail)
    raise KpScoringError(message, status_code=status, detail=detail)


def _retry_after(response: httpx.Response) -> float | None:
    """Retry-After in seconds: the service sends delta-seconds (an HTTP date reads as None)."""
    try:
        seconds = float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None
    return seconds if seconds >= 0 else None


def _base_url(given: str | None) -> str:
    """`given`, else the KP_URL variable (as the command line reads it), else the default."""
    return given or os.environ.get("KP_URL") or DEFAULT_URL


def _unreachable(base_url: httpx.URL, exc: httpx.TransportError) -> Unreachable:
    reason = visible(str(exc) or type(exc).__name__)
    return Unreachable(f"cannot reach kp-scoring at {base_url}: {reason}")


class _Base:
    def __init__(
        self,
        base_url: str,
        admin_token: str | None,
        api_key: str | None,
        retries: int,
        max_retry_wait: float,
        namespace: str | None,
    ) -> None:
        if retries < 0 or max_retry_wait < 0:
            raise ValueError("retries and max_retry_wait must not be negative")
        self.retries = retries
        self.max_retry_wait = max_retry_wait
        if api_key is None:
            api_key = os.environ.get("KP_API_KEY") or None
        admin = admin_token or api_key  # an API key with scope admin serves /cache too
        self._headers = {"Authorization": f"Bearer {admin}"} if admin else {}
        self._key_headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url
        self.namespace = namespace if namespace is not None else os.environ.get("KP_NAMESPACE")

    def _namespace_headers(self, namespace: str | None) -> dict[str, str]:
        chosen = namespace if namespace is not None else self.namespace
        return {NAMESPACE_HEADER: chosen} if chosen else {}

    def _scoring_headers(
        self, idempotency_key: str | None, namespace: str | None
    ) -> dict[str, str]:
        headers = {**self._key_headers, **self._namespace_headers(namespace)}
        if idempotency_key is not None:
            headers["Idempotency-Key"] = idempotency_key
        return headers

    def _admin_headers(self, namespace: str | None) -> dict[str, str]:
        return {**self._headers, **self._namespace_headers(namespace)}

    @staticmethod
    def _batch_body(traces: Iterable[TraceLike]) -> dict[str, Any]:
        return {"traces": [_trace_json(t) for t in traces]}

    def _wait_before_retry(self, exc: TryLater, attempt: int) -> float | None:
        """Seconds to wait before trying `exc`'s request again, or None to give up: no retries
        left, or a Retry-After longer than `max_retry_wait`."""
        if attempt >= self.retries:
            return None
        wait = DEFAULT_RETRY_WAIT if exc.retry_after is None else exc.retry_after
        return wait if wait <= self.max_retry_wait else None


class KpScoringClient(_Base):
    """Blocking client. Use as a context manager, or call `close()`.

    `base_url`: default the KP_URL variable, else http://127.0.0.1:8000. `api_key`: default
    the KP_API_KEY variable. `namespace`: the memory every request acts on (KP-Namespace;
    default the KP_NAMESPACE variable, else the key's namespace or `default`), overridden by a
    method's `namespace=`. `retries`: how many times a request answered 429 or 503 is sent
    again, each after the answer's Retry-After (1 s without one); a Retry-After above
    `max_retry_wait` seconds is not waited for: the `TryLater` error is raised at once.
    `sleep`: how to wait (tests).
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        admin_token: str | None = None,
        api_key: str | None = None,
        timeout: float = 10.0,
        retries: int = 0,
        max_retry_wait: float = 30.0,
        namespace: str | None = None,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        url = _base_url(base_url)
        super().__init__(url, admin_token, api_key, retries, max_retry_wait, namespace)
        self._http = httpx.Client(base_url=url, timeout=timeout, transport=transport)
        self._sleep = sleep

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        attempt = 0
        while True:
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                raise _unreachable(self._http.base_url, exc) from exc
            try:
                return _check(response)
            except TryLater as exc:
                wait = self._wait_before_retry(exc, attempt)
                if wait is None:
                    raise
            self._sleep(wait)
            attempt += 1

    def evaluate(
        self,
        trace: TraceLike,
        *,
        dry_run: bool = False,
        idempotency_key: str | None = None,
        namespace: str | None = None,
    ) -> EvaluationOut:
        body = self._request(
            "POST",
            "/evaluate",
            json=_trace_json(trace),
            params=_params(dry_run),
            headers=self._scoring_headers(idempotency_key, namespace),
        )
        return EvaluationOut.model_validate(body)

    def evaluate_batch(
        self,
        traces: Iterable[TraceLike],
        *,
        dry_run: bool = False,
        idempotency_key: str | None = None,
        namespace: str | None = None,
    ) -> list[EvaluationOut]:
        body = self._request(
            "POST",
            "/evaluate/batch",
            json=self._batch_body(traces),
            params=_params(dry_run),
            headers=self._scoring_headers(idempotency_key, namespace),
        )
        return BatchOut.model_validate(body).results

    def contribution(
        self,
        trace: TraceLike,
        *,
        dry_run: bool = False,
        idempotency_key: str | None = None,
        namespace: str | None = None,
        redact_suspected: bool | None = None,
        suspicious_threshold: float | None = None,
        reject_threshold: float | None = None,
    ) -> ContributionOut:
        """POST /contribution: the score (`evaluation`, as `evaluate` answers it) and the trace
        as the reference SDK's capture would contribute it, cleaned, with what was redacted,
        what would go uncleaned, every suspected leak the SDK's patterns leave (`findings`),
        whether any remains (`leaks_remain`) and the SDK's injection check of each text field.
        `redact_suspected`: also redact what is suspected (the contribution then differs from
        the SDK's); the thresholds: the injection classifier's (None: the service's)."""
        body = self._request(
            "POST",
            "/contribution",
            json=_trace_json(trace),
            params=_contribution_params(
                dry_run, redact_suspected, suspicious_threshold, reject_threshold
            ),
            headers=self._scoring_headers(idempotency_key, namespace),
        )
        return ContributionOut.model_validate(body)

    def jwks(self) -> dict[str, Any]:
        """The service's public signing keys (GET /.well-known/jwks.json)."""
        keys: dict[str, Any] = self._request("GET", "/.well-known/jwks.json")
        return keys

    def verify(
        self,
        signature: str,
        trace: TraceLike,
        *,
        issuer: str | None = None,
        audience: str | None = None,
        committed: bool = False,
        answer: dict[str, Any] | EvaluationOut | None = None,
        leeway_s: float = DEFAULT_LEEWAY_S,
        contribution: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The claims of a signed score about `trace` (as this client sent it), checked against
        the service's JWKS and, when given, the issuer, the audience, a committed score, every
        field of the answer and the contribution (POST /contribution's cleaned trace)
        (kp_scoring.signatures.verify); an `exp` honoured at most `leeway_s` seconds late;
        SignatureInvalidError if it does not verify."""
        return verify(
            signature,
            _trace_json(trace),
            self.jwks(),
            issuer=issuer,
            audience=audience,
            committed=committed,
            answer=answer,
            leeway_s=leeway_s,
            contribution=contribution,
        )

    def cache_stats(self, *, namespace: str | None = None) -> CacheOut:
        """The namespace's memory: size, limits, counters (admin)."""
        body = self._request("GET", "/cache", headers=self._admin_headers(namespace))
        return CacheOut.model_validate(body)

    def cache_reset(self, *, namespace: str | None = None) -> int:
        """Empty the namespace's memory; returns how many vectors it held (admin)."""
        body = self._request("DELETE", "/cache", headers=self._admin_headers(namespace))
        return ClearedOut.model_validate(body).cleared

    def cache_namespaces(self) -> list[str]:
        """The namespaces that hold entries, sorted (admin; a key bound to a namespace is
        refused: the list names every tenant)."""
        body = self._request("GET", "/cache/namespaces", headers=self._headers)
        return NamespacesOut.model_validate(body).namespaces

    def health(self) -> bool:
        """Whether the service answers its liveness probe (never raises)."""
        try:
            return self._http.get("/healthz").is_success
        except httpx.TransportError:
            return False

    def ready(self) -> ReadyOut:
        return ReadyOut.model_validate(self._request("GET", "/readyz"))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class AsyncKpScoringClient(_Base):
    """The same methods as `KpScoringClient`, awaitable. Use `async with`, or `await close()`."""

    def __init__(
        self,
        base_url: str | None = None,
        *,
        admin_token: str | None = None,
        api_key: str | None = None,
        timeout: float = 10.0,
        retries: int = 0,
        max_retry_wait: float = 30.0,
        namespace: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        url = _base_url(base_url)
        super().__init__(url, admin_token, api_key, retries, max_retry_wait, namespace)
        self._http = httpx.AsyncClient(base_url=url, timeout=timeout, transport=transport)
        self._sleep = sleep

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        attempt = 0
        while True:
            try:
                response = await self._http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                raise _unreachable(self._http.base_url, exc) from exc
            try:
                return _check(response)
            except TryLater as exc:
                wait = self._wait_before_retry(exc, attempt)
                if wait is None:
                    raise
            await self._sleep(wait)
            attempt += 1

    async def evaluate(
        self,
        trace: TraceLike,
        *,
        dry_run: bool = False,
        idempotency_key: str | None = None,
        namespace: str | None = None,
    ) -> EvaluationOut:
        body = await self._request(
            "POST",
            "/evaluate",
            json=_trace_json(trace),
            params=_params(dry_run),
            headers=self._scoring_headers(idempotency_key, namespace),
        )
        return EvaluationOut.model_validate(body)

    async def evaluate_batch(
        self,
        traces: Iterable[TraceLike],
        *,
        dry_run: bool = False,
        idempotency_key: str | None = None,
        namespace: str | None = None,
    ) -> list[EvaluationOut]:
        body = await self._request(
            "POST",
            "/evaluate/batch",
            json=self._batch_body(traces),
            params=_params(dry_run),
            headers=self._scoring_headers(idempotency_key, namespace),
        )
        return BatchOut.model_validate(body).results

    async def contribution(
        self,
        trace: TraceLike,
        *,
        dry_run: bool = False,
        idempotency_key: str | None = None,
        namespace: str | None = None,
        redact_suspected: bool | None = None,
        suspicious_threshold: float | None = None,
        reject_threshold: float | None = None,
    ) -> ContributionOut:
        """As `KpScoringClient.contribution`."""
        body = await self._request(
            "POST",
            "/contribution",
            json=_trace_json(trace),
            params=_contribution_params(
                dry_run, redact_suspected, suspicious_threshold, reject_threshold
            ),
            headers=self._scoring_headers(idempotency_key, namespace),
        )
        return ContributionOut.model_validate(body)

    async def jwks(self) -> dict[str, Any]:
        """The service's public signing keys (GET /.well-known/jwks.json)."""
        keys: dict[str, Any] = await self._request("GET", "/.well-known/jwks.json")
        return keys

    async def verify(
        self,
        signature: str,
        trace: TraceLike,
        *,
        issuer: str | None = None,
        audience: str | None = None,
        committed: bool = False,
        answer: dict[str, Any] | EvaluationOut | None = None,
        leeway_s: float = DEFAULT_LEEWAY_S,
        contribution: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """As `KpScoringClient.verify`."""
        return verify(
            signature,
            _trace_json(trace),
            await self.jwks(),
            issuer=issuer,
            audience=audience,
            committed=committed,
            answer=answer,
            leeway_s=leeway_s,
            contribution=contribution,
        )

    async def cache_stats(self, *, namespace: str | None = None) -> CacheOut:
        """The namespace's memory: size, limits, counters (admin)."""
        body = await self._request("GET", "/cache", headers=self._admin_headers(namespace))
        return CacheOut.model_validate(body)

    async def cache_reset(self, *, namespace: str | None = None) -> int:
        """Empty the namespace's memory; returns how many vectors it held (admin)."""
        body = await self._request("DELETE", "/cache", headers=self._admin_headers(namespace))
        return ClearedOut.model_validate(body).cleared

    async def cache_namespaces(self) -> list[str]:
        """As `KpScoringClient.cache_namespaces`."""
        body = await self._request("GET", "/cache/namespaces", headers=self._headers)
        return NamespacesOut.model_validate(body).namespaces

    async def health(self) -> bool:
        """Whether the service answers its liveness probe (never raises)."""
        try:
            return (await self._http.get("/healthz")).is_success
        except httpx.TransportError:
            return False

    async def ready(self) -> ReadyOut:
        return ReadyOut.model_validate(await self._request("GET", "/readyz"))

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
