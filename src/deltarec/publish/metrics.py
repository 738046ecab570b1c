"""Prometheus metrics of the publisher: rows, bytes, dumps, retries, freshness, held back.

Each :class:`PublishMetrics` owns its own ``CollectorRegistry`` (several publishers in one
process never clash); :meth:`PublishMetrics.serve` exposes it over HTTP for scraping. The same
metrics are served by ``deltarec publish --metrics-port`` and by the trainer's background
publisher (``make_train_hook(metrics_port=...)``).

**Freshness** counts from the training step whose rows a dump holds (the moment the dump was
taken, MANIFEST.json's ``taken_at``) to the moment they are readable in the store; the lag
counts from the manifest's commit. Both have a gauge (the last dump), a histogram, and p50 and
p99 gauges over the last :data:`WINDOW` dumps. Under a read-latency budget
(:mod:`deltarec.publish.budget`) the seconds the publisher paused for the readers add up in
``deltarec_publish_held_back_seconds_total``, beside the probes' last p99.
"""

from __future__ import annotations

import collections
import os
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from deltarec.stats import quantile

_LAG_BUCKETS = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
WINDOW = 1000
"""Dumps the p50 / p99 gauges are computed over."""

METRICS_HOST_ENV = "DELTAREC_METRICS_HOST"
"""The address the metrics servers of a trainer and of ``deltarec publish`` listen on;
unset: ``127.0.0.1`` (the pipeline's training pods set ``0.0.0.0`` for the scraper)."""


def metrics_host() -> str:
    """The address to serve metrics on: :data:`METRICS_HOST_ENV`, else loopback only."""
    return os.environ.get(METRICS_HOST_ENV, "").strip() or "127.0.0.1"


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
        self.freshness = Gauge(
            "deltarec_publish_freshness_seconds",
            "Seconds from the training step of the last published dump (when it was taken) "
            "to its rows being readable in the store",
            registry=r,
        )
        self.freshness_hist = Histogram(
            "deltarec_publish_freshness_hist_seconds",
            "Step-to-visible freshness of published dumps",
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.freshness_p50 = Gauge(
            "deltarec_publish_freshness_p50_seconds",
            f"Median step-to-visible freshness of the last {WINDOW} published dumps",
            registry=r,
        )
        self.freshness_p99 = Gauge(
            "deltarec_publish_freshness_p99_seconds",
            f"99th percentile step-to-visible freshness of the last {WINDOW} published dumps",
            registry=r,
        )
        self._recent: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._lock = threading.Lock()
        self.version = Gauge(
            "deltarec_publish_last_version", "Version of the last dump published", registry=r
        )
        self.held_back = Counter(
            "deltarec_publish_held_back_seconds",
            "Seconds the publisher paused to keep serving reads within the read-latency budget",
            registry=r,
        )
        self.read_probe_p99 = Gauge(
            "deltarec_publish_read_probe_p99_seconds",
            "p99 of the read-latency budget's last probe reads of serving keys",
            registry=r,
        )
        self.queued_bytes = Gauge(
            "deltarec_publish_queued_bytes",
            "Bytes of rows waiting in the background queue",
            registry=r,
        )

    def observe_visible(self, freshness_s: float, lag_s: float | None) -> None:
        """A dump part became readable in the store.

        Args:
            freshness_s: seconds since the dump was taken (its training step).
            lag_s: seconds since its manifest was committed (None: unknown).
        """
        if lag_s is not None:
            self.lag.set(lag_s)
            self.lag_hist.observe(max(0.0, lag_s))
        self.freshness.set(freshness_s)
        self.freshness_hist.observe(max(0.0, freshness_s))
        with self._lock:
            self._recent.append(freshness_s)
            ordered = sorted(self._recent)
        self.freshness_p50.set(quantile(ordered, 0.50))
        self.freshness_p99.set(quantile(ordered, 0.99))

    def serve(self, port: int, addr: str | None = None) -> None:
        """Serve ``/metrics`` on ``addr:port`` from a daemon thread.

        ``addr`` defaults to :func:`metrics_host` (loopback unless the environment says).
        """
        start_http_server(port, addr=addr or metrics_host(), registry=self.registry)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """The current value of a sample (for tests and summaries); 0 if absent."""
        v = self.registry.get_sample_value(name, labels or {})
        return float(v or 0.0)
