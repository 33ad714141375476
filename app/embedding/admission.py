"""Admission: the two limits that turn a request away, for real overload only.

A request that would put more than `queue_limit` texts in the queue is refused at the door; one
that has waited `max_wait_ms` without its run starting is refused when its turn comes. Both
limits are counts and wall time the operator sets, never this machine's speed.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.embedding.types import OverloadedError


@dataclass(frozen=True, slots=True)
class Admission:
    queue_limit: int = 256
    max_wait_ms: float = 10_000.0

    def check_door(self, queued: int, count: int) -> None:
        """OverloadedError if `count` more texts would pass the queue limit (a request larger
        than the limit is still taken when nothing else waits: it is not overload)."""
        if queued and queued + count > self.queue_limit:
            raise OverloadedError(
                f"{queued} texts are waiting for the model "
                f"(limit {self.queue_limit}, KP_EMBED_QUEUE_LIMIT)",
                "queue_limit",
            )

    def expired(self, waited_s: float) -> OverloadedError | None:
        """The error for a request that waited `waited_s` past the limit, or None."""
        waited_ms = waited_s * 1000
        if waited_ms <= self.max_wait_ms:
            return None
        return OverloadedError(
            f"waited {waited_ms:.0f} ms for the model "
            f"(limit {self.max_wait_ms:g} ms, KP_EMBED_MAX_WAIT_MS)",
            "waited_too_long",
        )
