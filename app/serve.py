"""The one way the service starts: `python -m app.serve` (make run, the image's CMD, the tests'
and the bench's servers) and `kp-scoring serve` both call `run`, which has uvicorn build the
app with its factory. No CLI framework is imported on this path: it is the cold start's."""

from __future__ import annotations

import argparse
import gc

#: uvicorn imports this and calls it (`--factory`): the settings are read then, not at import.
FACTORY = "app.main:create_app"
#: uvicorn's httptools protocol with header and body deadlines and header limits (KP_*).
HTTP_PROTOCOL = "app.server.protocol:LimitedHttpToolsProtocol"
#: The service has no WebSocket endpoint: uvicorn's WebSocket protocol and the websockets
#: library (about 7 ms of the cold start's imports) are not loaded. A request asking to
#: upgrade is answered as plain HTTP (app/server/protocol.py).
WEBSOCKETS = "none"


def run(host: str = "127.0.0.1", port: int = 8000, *, reload: bool = False) -> None:
    """One uvicorn process (the in-process cache lives in it): no workers, settings from KP_*."""
    prepare(reload=reload)
    import uvicorn

    uvicorn.run(
        FACTORY,
        factory=True,
        host=host,
        port=port,
        reload=reload,
        http=HTTP_PROTOCOL,
        ws=WEBSOCKETS,
    )


def prepare(*, reload: bool = False) -> None:
    """What the process does before uvicorn is imported (run's first step)."""
    # The start creates some 140,000 objects (modules, classes, schemas) that live as long as
    # the process; the cyclic collector would walk them again and again while they are made.
    # Off until the app has started: its lifespan freezes them and turns it back on
    # (app/main.py). Figures: docs/decisions/collector-off-during-start.md.
    if not reload:  # with reload the app lives in a child process, which loads its own
        gc.disable()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m app.serve", description="Run kp-scoring; settings from KP_* variables."
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--reload", action="store_true", help="restart on code changes")
    args = parser.parse_args(argv)
    run(args.host, args.port, reload=args.reload)


if __name__ == "__main__":
    main()
