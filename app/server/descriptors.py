"""File descriptors: a watch that says once (log, /metrics) when the process runs out of them
and once when it has them again (docs/operating/slow-clients.md, "Descriptors"). Out of them,
granian logs each accept that fails on its own logger (`_granian`), many a second: those lines
are counted here and left out of the log, which says it once instead."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
import threading
from pathlib import Path

from app.core.connection_metrics import CONNECTIONS

log = logging.getLogger("app.server")

_FD_DIR = Path("/proc/self/fd")
#: How often the watch counts the open descriptors.
WATCH_INTERVAL_S = 1.0
#: granian's logger, and what its line for an accept that failed for want of descriptors says.
GRANIAN_LOGGER = "_granian"
_ACCEPT_FAILED = "Failed to accept connection"
_NO_DESCRIPTORS = ("TooManyOpenFiles", "Too many open files", "code: 24,", "code: 23,")


def _can_count() -> bool:
    return _FD_DIR.is_dir()


class DescriptorAlarm:
    """Says once that the descriptors ran out (from the watch, or from the first accept that
    failed), counts the accepts that fail meanwhile, and says once that they are back. Called
    from the event loop and from granian's threads, hence the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.low = False
        self.refused_accepts = 0

    def exhausted(self, open_fds: int | None, limit: int) -> None:
        with self._lock:
            if self.low:
                return
            self.low = True
            self.refused_accepts = 0
        CONNECTIONS.descriptors_exhausted.inc()
        CONNECTIONS.descriptors_low.set(1)
        log.error(
            "out of file descriptors: new connections are refused until some close "
            "(KP_HEADER_TIMEOUT_S and KP_BODY_TIMEOUT_S bound slow ones; raise the "
            "hard limit: ulimit -n, docker run --ulimit nofile=N:N)",
            extra={"open": open_fds, "limit": limit},
        )

    def accept_failed(self) -> None:
        self.exhausted(None, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        with self._lock:
            self.refused_accepts += 1

    def recovered(self, open_fds: int, limit: int) -> None:
        with self._lock:
            if not self.low:
                return
            self.low = False
            refused = self.refused_accepts
        CONNECTIONS.descriptors_low.set(0)
        log.info(
            "file descriptors available again",
            extra={"open": open_fds, "limit": limit, "accepts_failed": refused},
        )


async def watch_descriptors() -> None:
    """Counts open descriptors every WATCH_INTERVAL_S; logs once when they come within 2% of
    the limit (kp_fd_exhausted, kp_fd_low) and once when they are back under 90%; granian's
    failed accepts meanwhile are counted into that second line."""
    if not _can_count():
        log.info("file descriptor watch off: no /proc/self/fd on this system")
        return
    alarm = DescriptorAlarm()

    def accept_failures(record: logging.LogRecord) -> bool:
        """Drops granian's line for an accept that failed for want of descriptors, counted."""
        message = record.getMessage()
        if _ACCEPT_FAILED in message and any(s in message for s in _NO_DESCRIPTORS):
            alarm.accept_failed()
            return False
        return True

    # On granian's handlers: its Rust side logs on child loggers (`_granian.<module>`), whose
    # records reach those handlers but not a filter of the parent logger.
    handlers = list(logging.getLogger(GRANIAN_LOGGER).handlers)
    for handler in handlers:
        handler.addFilter(accept_failures)
    try:
        while True:
            limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            try:
                # The listing's own descriptor is among those listed.
                open_fds = len(os.listdir(_FD_DIR)) - 1
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE):
                    raise
                open_fds = limit  # not one left to list them with
            if limit != resource.RLIM_INFINITY:
                if open_fds >= limit - max(2, limit // 50):  # within 2%
                    alarm.exhausted(open_fds, limit)
                elif open_fds < limit * 0.9:
                    alarm.recovered(open_fds, limit)
            await asyncio.sleep(WATCH_INTERVAL_S)
    finally:
        for handler in handlers:
            handler.removeFilter(accept_failures)
