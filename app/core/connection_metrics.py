"""Process-wide metrics of the HTTP connections: what the request bounds
(app/api/edge.py) and the descriptor watch count. One server runs per process,
whereas apps (each with its own registry, app/core/metrics.py) may be several: every app's
registry collects CONNECTIONS too."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.process_collector import ProcessCollector


class ConnectionMetrics(CollectorRegistry):
    def __init__(self) -> None:
        super().__init__(auto_describe=True)
        # The header deadline and size limits are granian's: it closes or answers 431 before
        # the app sees a request, so they are not counted here (docs/operating/slow-clients.md).
        self.closed_by_limit = Counter(
            "kp_http_closed_by_limit",
            "Requests refused and their connections closed by a bound, by limit: "
            "body_timeout (KP_BODY_TIMEOUT_S), host (HTTP/1.1 without exactly one Host).",
            ["limit"],
            registry=self,
        )
        for limit in ("body_timeout", "host"):
            self.closed_by_limit.labels(limit)
        self.descriptors_exhausted = Counter(
            "kp_fd_exhausted",
            "Times the open file descriptors came within 2% of the process's limit "
            "(process_max_fds): new connections are refused while it lasts.",
            registry=self,
        )
        self.descriptors_low = Gauge(
            "kp_fd_low",
            "1 while the open file descriptors are within 2% of the process's limit.",
            registry=self,
        )
        # process_open_fds, process_max_fds, memory and CPU of this process.
        ProcessCollector(registry=self)


#: The one set of connection metrics of this process.
CONNECTIONS = ConnectionMetrics()
