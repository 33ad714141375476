"""The MCP endpoint at /mcp. Its server (app/api/mcp_server.py) is loaded on the first /mcp
request, not at start: the SDK takes about as long to import as the rest of the service
(docs/decisions/mcp-in-process.md). With KP_EMBEDDER_PRELOAD=true it is loaded before the
service reports started, like the model.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from typing import TYPE_CHECKING, Final

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from app.core.health import Health
from app.service.scoring_service import ScoringService

if TYPE_CHECKING:
    from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

log = logging.getLogger(__name__)

PATH: Final = "/mcp"
_SERVER_MODULE: Final = "app.api.mcp_server"


class McpHost:
    """Runs the MCP transport for one run of the app, from its first use to the app's stop.
    The session manager runs a task group that must be entered and left in one task: `_serve`
    is that task."""

    def __init__(self, service: ScoringService) -> None:
        self._service = service
        self._ready = asyncio.get_running_loop().create_future()
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._failure: str | None = None

    def health(self) -> Health:
        """A warning in /readyz once the server failed to start (REST is not affected)."""
        if self._failure is None:
            return Health()
        why = f"mcp_unavailable: the MCP server could not start ({self._failure}); /mcp answers 503"
        return Health(warnings=(why,))

    async def transport(self) -> StreamableHTTPSessionManager:
        """The running session manager, started on the first call (concurrent callers share it)."""
        if self._task is None:
            self._task = asyncio.create_task(self._serve(), name="kp-mcp")
        return await asyncio.shield(self._ready)

    async def _serve(self) -> None:
        ready: asyncio.Future[StreamableHTTPSessionManager] = self._ready
        try:
            # Imported off the event loop: REST requests go on meanwhile.
            server = await asyncio.to_thread(importlib.import_module, _SERVER_MODULE)
            manager: StreamableHTTPSessionManager = server.session_manager(self._service)
            async with manager.run():
                ready.set_result(manager)
                await self._stopping.wait()
        except Exception as exc:
            log.exception("mcp: the MCP server could not start")
            self._failure = f"{type(exc).__name__}: {exc}"
            if not ready.done():
                ready.set_exception(exc)

    async def stop(self) -> None:
        self._stopping.set()
        if self._task is not None:
            await self._task


class _Handover(Response):
    """Hands the request, as it came, to the MCP transport, which answers it itself."""

    def __init__(self, manager: StreamableHTTPSessionManager) -> None:
        super().__init__()
        self.manager = manager

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.manager.handle_request(scope, receive, send)


# A FastAPI route, not a mounted app: Admission (keys, scopes, the namespace, limits) and the
# error handlers apply to /mcp as to the REST routes, before the MCP server sees it.
router = APIRouter()


# POST only: a stateless server has no session to end (DELETE) and never sends on a
# standalone stream (GET), which would only hold a connection open; the spec lets both be 405.
@router.post(PATH, include_in_schema=False)
async def mcp_endpoint(request: Request) -> Response:
    """Streamable HTTP: one JSON-RPC message in, its answer out (JSON)."""
    host: McpHost | None = getattr(request.app.state, "mcp", None)
    if host is None:
        return JSONResponse({"detail": "starting"}, status_code=503)
    try:
        manager = await host.transport()
    except Exception:  # logged where it failed; the REST API serves on
        return JSONResponse({"detail": "the MCP server could not start"}, status_code=503)
    return _Handover(manager)
