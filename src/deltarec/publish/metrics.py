"""Prometheus metrics of the publisher: rows, bytes, dumps, retries, freshness lag.

Each :class:`PublishMetrics` owns its own ``CollectorRegistry`` (several publishers in one
process never clash); :meth:`PublishMetrics.serve` exposes it over HTTP for scraping.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LAG_BUCKETS = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


class PublishMetrics:
    """The publisher's metrics.

    Args:
        registry: where to register (default: a new private registry).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.rows = Counter(
            "deltarec_publish_rows", "Rows written to the store", ["table", "mode"], registry=r
        )
        self.bytes = Counter(
            "deltarec_publish_bytes", "Encoded row bytes written", ["table", "mode"], registry=r
        )
        self.dumps = Counter(
            "deltarec_publish_dumps", "Dump parts (dump x rank) published", ["mode"], registry=r
        )
        self.retries = Counter(
            "deltarec_publish_retries",
            "Store operations retried after a transient error",
            registry=r,
        )
        self.lag = Gauge(
            "deltarec_publish_lag_seconds",
            "Seconds from the last published dump's commit to its visibility in the store",
            registry=r,
        )
        self.lag_hist = Histogram(
            "deltarec_publish_lag_hist_seconds",
            "Commit-to-visible lag of published dumps",
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.version = Gauge(
            "deltarec_publish_last_version", "Version of the last dump published", registry=r
        )
        self.queued_bytes = Gauge(
            "deltarec_publish_queued_bytes",
            "Bytes of rows waiting in the background queue",
            registry=r,
        )

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serve ``/metrics`` on ``addr:port`` from a daemon thread."""
        start_http_server(port, addr=addr, registry=self.registry)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """The current value of a sample (for tests and summaries); 0 if absent."""
        v = self.registry.get_sample_value(name, labels or {})
        return float(v or 0.0)
