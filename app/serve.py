"""The one way the service starts: `python -m app.serve` (make run, the image's CMD, the tests'
and the bench's servers) and `kp-scoring serve` both call `run`, which has uvicorn build the
app with its factory. No CLI framework is imported on this path: it is the cold start's."""

from __future__ import annotations

import argparse
import gc
import os

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
    """What the process does before uvicorn is imported (run's first step; bench.cold_probe
    calls it as well, then finds it done)."""
    # The service uses no pydantic plugin: the search for them (every installed package's
    # entry points, at the first model's build; about 4 ms) is skipped. A value set by the
    # user (e.g. empty: plugins on) is kept.
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    # The start creates some 140,000 objects (modules, classes, schemas) that live as long as
    # the process; the cyclic collector would walk them again and again while they are made,
    # about a tenth of the start's CPU. Off until the app has started: its lifespan turns it
    # back on (app/main.py).
    if not reload:  # with reload the app lives in a child process, which loads its own
        gc.disable()
        from app.services import early_load

        # First, so that the model loads while the web stack is imported and started.
        early_load.start()
        import_fastapi_deferring_its_models()


def import_fastapi_deferring_its_models() -> None:
    """FastAPI defines the pydantic models of an OpenAPI document (some 60 classes) when it is
    imported, and only /openapi.json and /docs use them: imported with pydantic's
    `defer_build`, they build their validators on that first use instead of at every start
    (about a tenth of the start's import CPU). The setting is put back at once, so only the
    models FastAPI defines here are deferred: the app's own build as before."""
    from pydantic import BaseModel

    config = BaseModel.model_config
    before = config.get("defer_build")
    config["defer_build"] = True
    try:
        import fastapi  # noqa: F401 - imported for its side effect, under the setting
    finally:
        if before is None:
            del config["defer_build"]
        else:
            config["defer_build"] = before


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
