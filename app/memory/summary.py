"""What the start and stop log lines say of the memory: where it lives, what it loaded, what
it keeps when the process ends (docs/operating/persistence.md)."""

from __future__ import annotations

from typing import Any

from app.memory.base import NoveltyMemory
from app.memory.in_process import InProcessMemory


def where(memory: NoveltyMemory) -> str:
    """The memory's place, as an operator names it."""
    backend = memory.backend
    if backend.kind == "redis":
        return f"Redis {backend.location} (prefix {backend.prefix})"
    if backend.location is None:
        return "the process only (nothing is kept when it stops)"
    return f"SQLite {backend.location}"


def at_start(memory: NoveltyMemory) -> dict[str, Any]:
    """The start line's fields: where the memory is and how many entries it holds (loaded
    from its database, or as the shared memory reports them)."""
    store = memory.store if isinstance(memory, InProcessMemory) else None
    fields: dict[str, Any] = {"memory": where(memory), "entries": memory.size}
    if store is not None and store.status.detail:
        fields["memory_detail"] = store.status.detail
    return fields


def at_stop(memory: NoveltyMemory) -> dict[str, Any]:
    """The stop line's fields, read once the memory is closed: what outlives the process (the
    database's entries, or the shared memory's as last seen) and what does not."""
    fields: dict[str, Any] = {"memory": where(memory)}
    if isinstance(memory, InProcessMemory):
        if memory.store is None:
            fields |= {"kept": 0, "dropped": memory.size}
        else:
            rows = memory.store.rows_by_namespace()
            fields |= {"kept": sum(rows.values()), "namespaces": len(rows)}
    else:
        fields["kept"] = memory.size
    return fields
