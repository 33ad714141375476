"""File descriptors: a watch that says (once, in the log and in /metrics) when the process
runs out of them.

Each open connection holds a descriptor; granian raises the soft limit to the hard one at
start (`ulimit -n`, docker run --ulimit nofile=N:N). At the limit it cannot accept and tells
no one, hence the watch.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
from pathlib import Path

from app.core.connection_metrics import CONNECTIONS

log = logging.getLogger("app.server")

_FD_DIR = Path("/proc/self/fd")
#: How often the watch counts the open descriptors.
WATCH_INTERVAL_S = 1.0


def _can_count() -> bool:
    return _FD_DIR.is_dir()


def _open_descriptors(limit: int) -> int:
    try:
        # The listing's own descriptor is among those listed.
        return len(os.listdir(_FD_DIR)) - 1
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            return limit  # not one left to list them with
        raise


def _running_out(open_fds: int, limit: int) -> bool:
    return open_fds >= limit - max(2, limit // 50)


async def watch_descriptors(interval_s: float = WATCH_INTERVAL_S) -> None:
    """Counts open descriptors every `interval_s`; logs once when they come within 2% of
    the limit (kp_fd_exhausted, kp_fd_low) and once when they are back under 90%."""
    if not _can_count():
        log.info("file descriptor watch off: no /proc/self/fd on this system")
        return
    low = False
    while True:
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        open_fds = _open_descriptors(limit)
        if limit != resource.RLIM_INFINITY:
            if not low and _running_out(open_fds, limit):
                low = True
                CONNECTIONS.descriptors_exhausted.inc()
                CONNECTIONS.descriptors_low.set(1)
                log.error(
                    "out of file descriptors: new connections are refused until some close "
                    "(KP_HEADER_TIMEOUT_S and KP_BODY_TIMEOUT_S bound slow ones; raise the "
                    "hard limit: ulimit -n, docker run --ulimit nofile=N:N)",
                    extra={"open": open_fds, "limit": limit},
                )
            elif low and open_fds < limit * 0.9:
                low = False
                CONNECTIONS.descriptors_low.set(0)
                log.info(
                    "file descriptors available again", extra={"open": open_fds, "limit": limit}
                )
        await asyncio.sleep(interval_s)
