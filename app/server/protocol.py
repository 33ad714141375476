"""uvicorn's httptools protocol with the bounds uvicorn lacks: a deadline for the headers and
one for the body (408, then close), limits on header size and count (431), and the HTTP/1.1
rule that a request names exactly one Host (400).

app/serve.py hands it to uvicorn (`http=`, by import string); the bounds come from the KP_*
settings (app/core/config.py), read when the first connection is made. Refusals have the API's
error body (app/core/errors.py). A connection that sent nothing by the header deadline is
closed without an answer: there is no request to answer. uvicorn's own keep-alive timeout
still closes an idle connection between requests sooner.
"""

from __future__ import annotations

import asyncio
import http
import logging
from typing import Any, ClassVar, cast

import httptools
import orjson
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from app.core.config import Settings
from app.core.connection_metrics import CONNECTIONS
from app.core.errors import SERVER_REFUSAL, error_body, field_error

log = logging.getLogger("app.server")

# After a refusal the rest of what the client sends is read and dropped for a while before the
# close (nginx's lingering close): a client that writes its whole request before it reads then
# sees the answer, not a reset. Bounded in time and bytes, so lingering holds no one up long.
LINGER_S = 2.0
LINGER_BYTES = 4 * 1024 * 1024


class _LimitError(Exception):
    """Raised in a parser callback: stops the parser; the connection answers and closes."""

    def __init__(self, status: int, limit: str, loc: tuple[str, ...], msg: str) -> None:
        super().__init__(msg)
        self.status = status
        self.limit = limit
        self.loc = loc
        self.msg = msg


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    #: The settings the bounds come from; read from the environment on first use.
    settings: ClassVar[Settings | None] = None

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        # The service writes its own access line (app/api/asgi/access_log.py) and disables
        # uvicorn's logger (app/core/logging.py); that logger keeps its handlers, so uvicorn
        # would still build its line's arguments (client address, quoted path) per response.
        self.access_log = False
        cls = type(self)
        if cls.settings is None:
            cls.settings = Settings.from_env()
        s = cls.settings
        self.header_timeout_s = s.header_timeout_s
        self.body_timeout_s = s.body_timeout_s
        self.max_header_bytes = s.max_header_bytes
        self.max_header_count = s.max_header_count
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_deadline = 0.0
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_cycle: RequestResponseCycle | None = None
        self._running: RequestResponseCycle | None = None
        #: Between the connect (or the previous answer) and the end of the next headers.
        self._awaiting_headers = False
        #: Bytes received while awaiting headers: bounds what the parser buffers.
        self._raw_header_bytes = 0
        #: The current request's header lines, as parsed.
        self._header_count = 0
        self._linger_timer: asyncio.TimerHandle | None = None
        self._linger_left = -1  # bytes still dropped after a refusal; -1: not lingering

    # ── the header deadline ──

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_headers()

    def _await_headers(self) -> None:
        self._awaiting_headers = True
        self._raw_header_bytes = 0
        self._header_deadline = self.loop.time() + self.header_timeout_s
        # One timer per connection, moved on when it fires early: no timer per request.
        if self._header_timer is None:
            self._header_timer = self.loop.call_at(self._header_deadline, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or not self._awaiting_headers:
            return  # armed again by the next _await_headers
        if self.loop.time() < self._header_deadline:
            self._header_timer = self.loop.call_at(self._header_deadline, self._header_timeout)
            return
        if self._raw_header_bytes == 0:
            CONNECTIONS.closed_by_limit.labels("idle").inc()
            self.transport.close()
            return
        self._refuse(
            _LimitError(
                408,
                "header_timeout",
                ("header",),
                f"the request headers did not arrive within {self.header_timeout_s:g} s "
                "(KP_HEADER_TIMEOUT_S)",
            )
        )

    def data_received(self, data: bytes) -> None:
        if self._linger_left >= 0:
            self._linger_left -= len(data)
            if self._linger_left < 0:
                self.transport.close()
            return
        self._unset_keepalive_if_required()
        if self._awaiting_headers:
            self._raw_header_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, _LimitError):
                self._refuse(exc.__context__)
            else:
                self._invalid_request()
            return
        except httptools.HttpParserError:
            self._invalid_request()
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        if self._awaiting_headers:
            if self._raw_header_bytes > self.max_header_bytes:
                # Header lines that never end: refused before the parser buffers more.
                self._refuse(self._too_large())
        else:
            self._watch_body()

    def _unsupported_upgrade_warning(self) -> None:
        """A request asking to switch protocols (WebSocket, h2c): the service speaks HTTP/1.1
        only and answers it as a plain request, as HTTP lets a server do (RFC 9110, 7.8),
        without uvicorn's warnings (one of them about a missing WebSocket library). The parser
        reads nothing more of a connection after an upgrade request: it closes after the
        answer instead of leaving the client's next request unread."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.keep_alive = False
        else:
            self.transport.close()

    def _invalid_request(self) -> None:
        msg = "Invalid HTTP request received."
        self.logger.warning(msg)
        self.send_400_response(msg)

    # ── header limits and Host ──

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_count = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.max_header_count:
            raise _LimitError(
                431,
                "header_count",
                ("header",),
                f"more than {self.max_header_count} header lines (KP_MAX_HEADER_COUNT)",
            )
        super().on_header(name, value)

    def _too_large(self) -> _LimitError:
        return _LimitError(
            431,
            "header_bytes",
            ("header",),
            f"the request line and headers are larger than {self.max_header_bytes} bytes "
            "(KP_MAX_HEADER_BYTES)",
        )

    def on_headers_complete(self) -> None:
        # Everything received since the deadline started is within the limit: so are the
        # headers. Otherwise (the body came along, or a pipelined request) they are counted.
        if not self._awaiting_headers or self._raw_header_bytes > self.max_header_bytes:
            size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
            if size > self.max_header_bytes:
                raise self._too_large()
        self._awaiting_headers = False
        hosts = [value for name, value in self.headers if name == b"host"]
        if len(hosts) > 1 or (not hosts and self.parser.get_http_version() == "1.1"):
            raise _LimitError(
                400,
                "host",
                ("header", "host"),
                "an HTTP/1.1 request must have exactly one Host header (RFC 9112, 3.2)",
            )
        super().on_headers_complete()

    # ── the body deadline ──

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        super()._start_asgi_task(cycle, app)
        self._running = cycle

    def _watch_body(self) -> None:
        """Starts the body deadline of the running request if its body is not all here: only
        a body that spans reads has a timer. A pipelined request's starts with its turn."""
        cycle = self._running
        if (
            cycle is not None
            and cycle.more_body
            and self._body_cycle is not cycle
            and not cycle.response_complete
            and not self.transport.is_closing()
        ):
            self._cancel_body_timer()
            self._body_cycle = cycle
            self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_timeout)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        cycle = self.cycle
        if self._body_cycle is cycle:
            self._cancel_body_timer()
        if cycle is not None and cycle.response_complete and not self.transport.is_closing():
            # Answered before its body was all read: the next request starts now.
            self._await_headers()

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._body_cycle = None

    def _body_timeout(self) -> None:
        cycle = self._body_cycle
        self._body_timer = None
        self._body_cycle = None
        if cycle is None or self.transport.is_closing() or not cycle.more_body:
            return
        refusal = _LimitError(
            408,
            "body_timeout",
            ("body",),
            f"the request body did not arrive within {self.body_timeout_s:g} s (KP_BODY_TIMEOUT_S)",
        )
        # The application waits for the rest of the body: it learns of the close at once, and
        # nothing it sends from now on reaches the transport; what it logs is our answer.
        started = cycle.response_started
        scope = cast("dict[str, Any]", cycle.scope)
        scope[SERVER_REFUSAL] = (refusal.status, self._body(refusal))
        cycle.disconnected = True
        cycle.message_event.set()
        if started:
            CONNECTIONS.closed_by_limit.labels(refusal.limit).inc()
            self.transport.close()
        else:
            self._refuse(refusal, answer=True)

    # ── answering a refusal ──

    def _refuse(self, refusal: _LimitError, *, answer: bool | None = None) -> None:
        """Answers `refusal` (unless a response is under way) and closes the connection."""
        CONNECTIONS.closed_by_limit.labels(refusal.limit).inc()
        log.debug("connection closed by a limit", extra={"limit": refusal.limit})
        self._cancel_header_timer()
        self._cancel_body_timer()
        if answer is None:
            # A pipelined request refused while an earlier one is answered: no room for ours.
            answer = self.cycle is None or self.cycle.response_complete
        if not answer or self.transport.is_closing():
            self.transport.close()
            return
        self.transport.write(self._response(refusal))
        self._linger_left = LINGER_BYTES
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)

    @staticmethod
    def _body(refusal: _LimitError) -> dict[str, Any]:
        return error_body([field_error(refusal.loc, refusal.msg, refusal.limit)])

    def _response(self, refusal: _LimitError) -> bytes:
        body = orjson.dumps(self._body(refusal))
        phrase = http.HTTPStatus(refusal.status).phrase
        lines = [f"HTTP/1.1 {refusal.status} {phrase}".encode()]
        lines += [name + b": " + value for name, value in self.server_state.default_headers]
        lines += [
            b"content-type: application/json",
            b"content-length: %d" % len(body),
            b"connection: close",
        ]
        return b"\r\n".join(lines) + b"\r\n\r\n" + body

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if pipelined:
            self._watch_body()
        elif self._running is None or not self._running.more_body:
            self._await_headers()
        # else: the rest of the body comes first (on_message_complete), under its deadline.

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        self._cancel_body_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)
