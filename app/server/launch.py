"""How the service is served: uvicorn with the protocol that bounds slow and oversized
requests (app/server/protocol.py). Every way to start it passes these options."""

from __future__ import annotations

#: uvicorn's `--http` (or `http=`): httptools with header/body deadlines and header limits.
HTTP_PROTOCOL = "app.server.protocol:LimitedHttpToolsProtocol"

#: The uvicorn command-line options that go with every start of the service.
UVICORN_OPTIONS = ("--http", HTTP_PROTOCOL)
