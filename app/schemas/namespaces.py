"""A namespace's name as the API publishes it (docs/api.md, namespaces): in the MCP tools'
arguments and in GET /cache/namespaces. The rule itself is app/core/namespaces.py."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from app.core import namespaces

Namespace = Annotated[
    str,
    Field(
        pattern=namespaces.PATTERN,
        min_length=1,
        max_length=64,
        description="A namespace: 1 to 64 letters, digits, '.', '_' or '-'.",
    ),
]


class NamespacesOut(BaseModel):
    #: Sorted; a namespace is listed while it holds at least one entry.
    namespaces: list[Namespace]
    #: KP_MAX_NAMESPACES: how many namespaces may hold entries at once.
    limit: int
