"""`python -m app.serve` (make run, the image, the tests' and the bench's servers): `app.main:app`
served by granian, whose HTTP/1 server holds the header deadline and limits
(docs/decisions/connection-edge.md, docs/operating/slow-clients.md). No CLI framework is
imported on this path: it is the cold start's."""

from __future__ import annotations

import argparse
import asyncio
import errno
import gc
import logging
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.core.config import Settings


def run(host: str = "127.0.0.1", port: int = 8000) -> None:
    """One process (the in-process cache lives in it): granian's server embedded in this
    process's event loop, no worker processes; settings from KP_*."""
    check_port_free(host, port)
    # The cyclic collector off until the app's lifespan has frozen what the start made
    # (docs/decisions/collector-off-during-start.md); before the web stack is imported.
    gc.disable()
    from app.main import app as served  # built from the environment (KP_*)

    settings: Settings = served.state.settings
    if settings.redis_url is not None:
        # One line, before the server starts, for a Redis without vector search.
        from app.core.config import redis_location
        from app.memory.redis_parts import refuse_without_query_engine

        url = settings.redis_url.get_secret_value()
        refuse_without_query_engine(url, redis_location(url))
    elif settings.cache_db_path is not None:
        # One line, before the server starts, for a database another process owns or a later
        # release wrote (the memory refuses it again when it opens it).
        from app.core.config import config_error
        from app.memory.ownership import refusal

        refused = refusal(settings.cache_db_path)
        if refused is not None:
            raise config_error("CACHE_DB_PATH", refused)
    from app.server.header_limit import HeaderLimit

    served.state.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    app = HeaderLimit(served, settings.max_header_bytes)
    # asyncio's own loop: uvloop measured no different here (docs/decisions/connection-edge.md).
    asyncio.run(_serve(app, host, port, settings))


def check_port_free(host: str, port: int) -> None:
    """Stops the start with one clear line when the address is taken: a plain bind fails for
    any listener there, which granian's SO_REUSEPORT would join unnoticed."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise SystemExit(
                    f"kp-scoring: cannot listen on {host}:{port}: the port is taken (another "
                    "server runs there?); choose another with --port (make run PORT=8001)"
                ) from None
            raise SystemExit(
                f"kp-scoring: cannot listen on {host}:{port}: {exc.strerror}"
            ) from None


async def _serve(app: object, host: str, port: int, settings: Settings) -> None:
    from granian.constants import HTTPModes, Interfaces
    from granian.http import HTTP1Settings
    from granian.log import LogLevels
    from granian.server.embed import Server

    server = Server(
        app,
        address=host,
        port=port,
        interface=Interfaces.ASGI,
        http=HTTPModes.http1,
        # No WebSocket endpoint: an upgrade request is answered as plain HTTP.
        websockets=False,
        # Also the connections served at once: granian accepts no more past it (the rest wait
        # in the kernel's queue); its embedded default, 128, would cap a crowd of kept-alive
        # clients. Descriptors are the real bound (app/server/descriptors.py).
        backlog=2048,
        http1_settings=HTTP1Settings(
            header_read_timeout=max(1, round(settings.header_timeout_s * 1000)),
            # hyper's own check of the limit is loose (app/server/header_limit.py is exact).
            max_buffer_size=settings.max_header_bytes,
        ),
        # The service logs its own JSON lines (app/core/logging.py); granian's own (plain
        # text) only for its errors.
        log_level=LogLevels.error,
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.signal_handler_interrupt)
    await server.serve()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m app.serve", description="Run kp-scoring; settings from KP_* variables."
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    args = parser.parse_args(argv)
    run(args.host, args.port)
    exit_after_stop()


def exit_after_stop() -> None:
    """Ends the process once the server and the app's lifespan (which closed what the service
    owns) have stopped, without the interpreter's finalization, in which granian's threads may
    panic (docs/decisions/connection-edge.md)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
