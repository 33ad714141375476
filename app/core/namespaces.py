"""Namespaces as a request names them (docs/api.md, namespaces): the `KP-Namespace` header, an
API key bound to one, else `default`. A namespace's memory is its own: a trace is compared
only with its namespace's traces.

The name's rule keeps it safe wherever a name goes: a Redis key and its hash tag (no braces),
a metric's label, a log line, a file name. It is the rule of API key names."""

from __future__ import annotations

import re
from typing import Final

from app.core.errors import Loc, ServiceError

#: The header that names a request's namespace.
HEADER: Final = "KP-Namespace"
#: Where a refusal points, in the project's error shape (`loc`).
LOC: Final = ("header", "kp-namespace")
#: The namespace of a request that names none (app/memory/base.py says the same).
DEFAULT: Final = "default"
PATTERN: Final = r"^[A-Za-z0-9._-]{1,64}$"
RULE: Final = "must be 1 to 64 characters of letters, digits, '.', '_' and '-'"
_NAME = re.compile(PATTERN)


def resolve(
    given: str | None,
    *,
    key_name: str | None,
    bound: str | None,
    loc: Loc = LOC,
    named: str = HEADER,
) -> str:
    """The namespace a request acts on: `given` (the header, or an MCP tool's argument: `loc`
    and `named` say which), else the key's `bound` namespace, else DEFAULT. A bound key uses its
    namespace alone: ServiceError 422 (namespace_invalid) or 403 (namespace_forbidden)."""
    if given is None:
        return bound or DEFAULT
    if not _NAME.fullmatch(given):
        # Not echoed: the value may hold anything a header can carry.
        rule = f"{named} {RULE}" if named else RULE
        raise ServiceError(422, "namespace_invalid", rule, loc=loc)
    if bound is not None and given != bound:
        raise ServiceError(
            403,
            "namespace_forbidden",
            f"the API key {key_name!r} is bound to the namespace {bound!r} and may use no "
            f"other: {given!r} refused (send no {HEADER}, or {HEADER}: {bound})",
            loc=loc,
        )
    return given
