"""The id of the request being served, for log lines written anywhere below the middleware."""

from contextvars import ContextVar

request_id_var: ContextVar[str | None] = ContextVar("request_id", default=None)
