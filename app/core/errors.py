"""The service's error types (docs/decisions/one-door.md): every refusal is a ServiceError,
rendered once by each transport (REST: app/api/errors.py; MCP: a tool error of the same kind);
a PartError is a part that could not do its work, and the service degrades instead of refusing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Loc = Sequence[str | int]


@dataclass(frozen=True, slots=True)
class Problem:
    """One fault of a request: where (`loc`), what rule (`msg`), its `type`; `extra` adds
    fields of the answer's entry (an import's bad `line`)."""

    loc: tuple[str | int, ...]
    msg: str
    type: str
    extra: Mapping[str, Any] = field(default_factory=dict)


class ServiceError(Exception):
    """A refusal: nothing was changed. `problems`: the request's faults, each naming its
    field (None: the service's own state is at fault, said in `message`)."""

    def __init__(
        self,
        status: int,
        kind: str,
        message: str,
        *,
        loc: Loc | None = None,
        problems: Sequence[Problem] | None = None,
        retry_after: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message
        if problems is None and loc is not None:
            problems = [Problem(tuple(loc), message, kind)]
        self.problems: tuple[Problem, ...] | None = None if problems is None else tuple(problems)
        self.retry_after = retry_after
        self.headers = dict(headers or {})


def invalid(problems: Sequence[Problem], status: int = 422) -> ServiceError:
    """A request whose content breaks rules (422 unless said), every fault named."""
    kind = problems[0].type if problems else "invalid"
    message = "; ".join(p.msg for p in problems)
    return ServiceError(status, kind, message, problems=problems)


class PartError(Exception):
    """A part of the service could not do its work (a model file, a database write, Redis);
    the service degrades, as the docs say, rather than refuse."""


def problems_of(errors: Iterable[Mapping[str, Any]]) -> list[Problem]:
    """Problems from entries of FastAPI's (pydantic's) shape; nothing else they carry (pydantic
    echoes the offending input, which may be a trace's text) is kept."""
    return [Problem(tuple(e["loc"]), str(e["msg"]), str(e["type"])) for e in errors]
