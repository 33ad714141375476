"""A typed Python client for the kp-scoring service, sync and async, on httpx.

    with KpScoringClient("http://127.0.0.1:8000") as kp:
        result = kp.evaluate(trace)          # a dict or a ReasoningTrace
        print(result.score, result.dimensions.novelty)
        if result.novelty.nearest:           # the stored trace it resembles most
            print(result.novelty.nearest.trace_id, result.novelty.nearest.age_ms)

Every failure is a `KpScoringError`: `Unreachable` (no answer), `ValidationFailed` (422, with
the field paths), `Unauthorized` (401), `Forbidden` (403), `RateLimited` (429, with
`retry_after`), `Overloaded` (503, with `retry_after`), or the base class for any other error
status. `api_key` (default: the KP_API_KEY variable) is sent with every scoring request.
`verify_signature` checks a signed score against the trace and the service's JWKS.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import httpx

from app.core.signatures import SignatureInvalidError, trace_sha256, verify
from app.schemas.responses import BatchOut, CacheOut, ClearedOut, EvaluationOut, ReadyOut
from app.schemas.trace import ReasoningTrace

#: Checks a signed score: the claims, or SignatureInvalidError (see app.services.signing).
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
    "Unauthorized",
    "Unreachable",
    "ValidationFailed",
    "trace_sha256",
    "verify_signature",
]

DEFAULT_URL = "http://127.0.0.1:8000"

TraceLike = ReasoningTrace | Mapping[str, Any]


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
        return f"{self.path}: {self.msg}"


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
    """403: the API key lacks the scope the request needs."""


class RateLimited(KpScoringError):  # noqa: N818
    """429: the API key is over its rate; nothing was scored; retry after `retry_after` s."""

    def __init__(self, message: str, *, retry_after: float | None, detail: Any = None) -> None:
        super().__init__(message, status_code=429, detail=detail)
        self.retry_after = retry_after


class Overloaded(KpScoringError):  # noqa: N818
    """503: the service is busy; try again after `retry_after` seconds."""

    def __init__(self, message: str, *, retry_after: float | None, detail: Any = None) -> None:
        super().__init__(message, status_code=503, detail=detail)
        self.retry_after = retry_after


def _field_errors(detail: Any) -> list[FieldError]:
    if not isinstance(detail, list):
        return []
    return [
        FieldError(tuple(e.get("loc", ())), str(e.get("msg", "")), str(e.get("type", "")))
        for e in detail
        if isinstance(e, dict)
    ]


def _trace_json(trace: TraceLike) -> dict[str, Any]:
    if isinstance(trace, ReasoningTrace):
        return trace.model_dump(mode="json", by_alias=True, exclude_none=True)
    return dict(trace)


def _params(dry_run: bool) -> dict[str, str]:
    return {"dry_run": "true"} if dry_run else {}


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
        text = str(detail) if detail else response.reason_phrase
    message = f"{status} {response.reason_phrase}: {text}"
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
    try:
        return float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None


def _unreachable(base_url: httpx.URL, exc: httpx.TransportError) -> Unreachable:
    return Unreachable(f"cannot reach kp-scoring at {base_url}: {str(exc) or type(exc).__name__}")


class _Base:
    def __init__(self, base_url: str, admin_token: str | None, api_key: str | None) -> None:
        if api_key is None:
            api_key = os.environ.get("KP_API_KEY") or None
        admin = admin_token or api_key  # an API key with scope admin serves /cache too
        self._headers = {"Authorization": f"Bearer {admin}"} if admin else {}
        self._key_headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url

    def _scoring_headers(self, idempotency_key: str | None) -> dict[str, str]:
        if idempotency_key is None:
            return self._key_headers
        return {**self._key_headers, "Idempotency-Key": idempotency_key}

    @staticmethod
    def _batch_body(traces: Iterable[TraceLike]) -> dict[str, Any]:
        return {"traces": [_trace_json(t) for t in traces]}


class KpScoringClient(_Base):
    """Blocking client. Use as a context manager, or call `close()`."""

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        *,
        admin_token: str | None = None,
        api_key: str | None = None,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(base_url, admin_token, api_key)
        self._http = httpx.Client(base_url=base_url, timeout=timeout, transport=transport)

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise _unreachable(self._http.base_url, exc) from exc
        return _check(response)

    def evaluate(
        self, trace: TraceLike, *, dry_run: bool = False, idempotency_key: str | None = None
    ) -> EvaluationOut:
        body = self._request(
            "POST",
            "/evaluate",
            json=_trace_json(trace),
            params=_params(dry_run),
            headers=self._scoring_headers(idempotency_key),
        )
        return EvaluationOut.model_validate(body)

    def evaluate_batch(
        self,
        traces: Iterable[TraceLike],
        *,
        dry_run: bool = False,
        idempotency_key: str | None = None,
    ) -> list[EvaluationOut]:
        body = self._request(
            "POST",
            "/evaluate/batch",
            json=self._batch_body(traces),
            params=_params(dry_run),
            headers=self._scoring_headers(idempotency_key),
        )
        return BatchOut.model_validate(body).results

    def jwks(self) -> dict[str, Any]:
        """The service's public signing keys (GET /.well-known/jwks.json)."""
        keys: dict[str, Any] = self._request("GET", "/.well-known/jwks.json")
        return keys

    def verify(self, signature: str, trace: TraceLike) -> dict[str, Any]:
        """The claims of a signed score about `trace` (as this client sent it), checked against
        the service's JWKS; SignatureInvalidError if it does not verify."""
        return verify(signature, _trace_json(trace), self.jwks())

    def cache_stats(self) -> CacheOut:
        return CacheOut.model_validate(self._request("GET", "/cache", headers=self._headers))

    def cache_reset(self) -> int:
        """Empty the cache; returns how many vectors it held."""
        body = self._request("DELETE", "/cache", headers=self._headers)
        return ClearedOut.model_validate(body).cleared

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
        base_url: str = DEFAULT_URL,
        *,
        admin_token: str | None = None,
        api_key: str | None = None,
        timeout: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(base_url, admin_token, api_key)
        self._http = httpx.AsyncClient(base_url=base_url, timeout=timeout, transport=transport)

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise _unreachable(self._http.base_url, exc) from exc
        return _check(response)

    async def evaluate(
        self, trace: TraceLike, *, dry_run: bool = False, idempotency_key: str | None = None
    ) -> EvaluationOut:
        body = await self._request(
            "POST",
            "/evaluate",
            json=_trace_json(trace),
            params=_params(dry_run),
            headers=self._scoring_headers(idempotency_key),
        )
        return EvaluationOut.model_validate(body)

    async def evaluate_batch(
        self,
        traces: Iterable[TraceLike],
        *,
        dry_run: bool = False,
        idempotency_key: str | None = None,
    ) -> list[EvaluationOut]:
        body = await self._request(
            "POST",
            "/evaluate/batch",
            json=self._batch_body(traces),
            params=_params(dry_run),
            headers=self._scoring_headers(idempotency_key),
        )
        return BatchOut.model_validate(body).results

    async def jwks(self) -> dict[str, Any]:
        """The service's public signing keys (GET /.well-known/jwks.json)."""
        keys: dict[str, Any] = await self._request("GET", "/.well-known/jwks.json")
        return keys

    async def verify(self, signature: str, trace: TraceLike) -> dict[str, Any]:
        """As `KpScoringClient.verify`."""
        return verify(signature, _trace_json(trace), await self.jwks())

    async def cache_stats(self) -> CacheOut:
        body = await self._request("GET", "/cache", headers=self._headers)
        return CacheOut.model_validate(body)

    async def cache_reset(self) -> int:
        """Empty the cache; returns how many vectors it held."""
        body = await self._request("DELETE", "/cache", headers=self._headers)
        return ClearedOut.model_validate(body).cleared

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
