"""Prometheus metrics, one registry per app so that several apps can live in one process.

Counted here: what requests do. The running service's parts (cache, its database, embedder)
expose their own figures through app.service.runtime.Runtime.collect."""

from __future__ import annotations

from functools import partial
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram

from app.core.connection_metrics import CONNECTIONS

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
#: Up to KP_EMBED_MAX_WAIT_MS's default (10 s): past it a request is turned away.
_QUEUE_WAIT_BUCKETS = (*_LATENCY_BUCKETS, 5.0, 10.0)

_Labelled = TypeVar("_Labelled", Counter, Histogram)

#: The `namespace` label of every namespace past the bound: not a namespace's name (parentheses
#: break the name's rule), so it cannot be mistaken for one.
OTHER_NAMESPACES = "(other)"


class Metrics:
    """`namespace_labels`: how many namespaces get a label value of their own (the first this
    process sees); the others are counted together under OTHER_NAMESPACES (KP_METRICS_NAMESPACES,
    docs/operating/metrics.md)."""

    def __init__(self, namespace_labels: int = 20) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[object, tuple[str, ...]], Any] = {}
        self._namespace_labels = namespace_labels
        self._labelled_namespaces: set[str] = set()
        self.registry.register(CONNECTIONS)
        counter = partial(Counter, registry=self.registry)
        histogram = partial(Histogram, registry=self.registry)
        self.requests = counter(
            "kp_http_requests", "HTTP requests by route and status.", ["route", "method", "status"]
        )
        self.latency = histogram(
            "kp_http_request_duration_seconds",
            "HTTP request latency by route.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
        )
        self.errors = counter(
            "kp_http_errors",
            "Requests answered with 4xx or 5xx, by route and status.",
            ["route", "status"],
        )
        self.scoring_requests = counter(
            "kp_scoring_requests",
            "Scoring requests (one trace, or a batch) by transport (rest: POST /evaluate*, "
            "mcp: the /mcp tools) and kind (one, batch), refused ones included.",
            ["transport", "kind"],
        )
        self.evaluations = counter(
            "kp_evaluations", "Traces scored, by weight profile.", ["profile"]
        )
        self.overrides = counter("kp_overrides", "Rule overrides fired, by rule.", ["rule"])
        self.novelty_unmeasured = counter(
            "kp_novelty_unmeasured", "Traces whose novelty was not measured, by reason.", ["reason"]
        )
        self.novelty_search = counter(
            "kp_novelty_search",
            "Traces whose novelty was measured, by how the memory found the nearest: exact "
            "(the in-process scan, Redis's FLAT) or index (Redis's HNSW).",
            ["search"],
        )
        self.score = histogram("kp_score", "Scores given.", buckets=[i / 10 for i in range(1, 11)])
        self.overloaded = counter(
            "kp_overloaded",
            "Requests turned away with 503, by limit: queue_limit (KP_EMBED_QUEUE_LIMIT) or "
            "waited_too_long (waited past KP_EMBED_MAX_WAIT_MS for the model).",
            ["reason"],
        )
        self.embed_queue_wait = histogram(
            "kp_embed_queue_wait_seconds",
            "Time a request waited in the queue before its model run started.",
            buckets=_QUEUE_WAIT_BUCKETS,
        )
        self.embed_run = histogram(
            "kp_embed_run_seconds",
            "Time of one model run (the texts of one or more requests).",
            buckets=_LATENCY_BUCKETS,
        )
        # The embedding service's observer (app/embedding/types.py, EmbedObserver).
        self.queue_waited = self.embed_queue_wait.observe
        self.model_ran = self.embed_run.observe
        self.auth_refused = counter(
            "kp_auth_refused",
            "Requests refused for their API key: missing, unknown_key (401), missing_scope (403), "
            "namespace_forbidden (403: a key bound to another namespace).",
            ["reason"],
        )
        # Key names come from KP_API_KEYS_FILE: their number is bounded by the operator.
        self.key_requests = counter(
            "kp_api_key_requests",
            "Requests with an API key, by key name and outcome (admitted, rate_limited).",
            ["key", "outcome"],
        )
        self.rate_limit_unavailable = counter(
            "kp_rate_limit_unavailable",
            "Requests let through unchecked because the shared rate limit's Redis did not answer.",
        )
        self.namespace_evaluations = counter(
            "kp_namespace_evaluations",
            "Traces scored, by namespace: up to KP_METRICS_NAMESPACES of them by name (the first "
            f"this process scores), the rest together as {OTHER_NAMESPACES}.",
            ["namespace"],
        )
        self.namespace_limit = counter(
            "kp_namespace_limit_refused",
            "Requests refused with 409 because a new namespace would pass KP_MAX_NAMESPACES.",
        )
        self.idempotency = counter(
            "kp_idempotency",
            "Requests with an Idempotency-Key, by what happened: run, replay, mismatch (422), "
            "in_progress (409).",
            ["action"],
        )

    def namespace_label(self, namespace: str) -> str:
        """The namespace's label value: its name while the bound leaves room, else
        OTHER_NAMESPACES. A name once labelled keeps its label for the process's life."""
        if namespace not in self._labelled_namespaces:
            if len(self._labelled_namespaces) >= self._namespace_labels:
                return OTHER_NAMESPACES
            self._labelled_namespaces.add(namespace)
        return namespace

    def child(self, metric: _Labelled, *values: str) -> _Labelled:
        """`metric.labels(*values)`, kept once made: prometheus-client's `labels` checks the
        values and takes a lock at every call, several times a request on the hot path. A
        child lives as long as its metric (nothing here removes one)."""
        key = (metric, values)
        found: _Labelled | None = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found
