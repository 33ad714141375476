"""The one way the service starts: `kp-scoring serve` (make run, the image's CMD, the tests'
and the bench's servers) calls `run`, which has uvicorn build the app with its factory."""

from __future__ import annotations

import uvicorn

#: uvicorn imports this and calls it (`--factory`): the settings are read then, not at import.
FACTORY = "app.main:create_app"


def run(host: str = "127.0.0.1", port: int = 8000, *, reload: bool = False) -> None:
    """One uvicorn process (the in-process cache lives in it): no workers, settings from KP_*."""
    uvicorn.run(FACTORY, factory=True, host=host, port=port, reload=reload)
