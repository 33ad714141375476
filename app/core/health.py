"""What each part of the running service says about itself for /readyz."""

from __future__ import annotations

from dataclasses import dataclass

#: How a warning about a part that leaves novelty unmeasured begins.
UNMEASURED = "novelty is not measured (fixed at 0.5): "


@dataclass(frozen=True, slots=True)
class Health:
    #: The service answers, but a part works below its promise (novelty not measured).
    degraded: bool = False
    warnings: tuple[str, ...] = ()
