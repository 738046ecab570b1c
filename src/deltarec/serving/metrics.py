"""Prometheus metrics of a replica: position, lag, freshness, applies and lookups.

Position and lag are read from the follower when scraped (a collector), so they are never
stale; lookups are counted and timed by the HTTP endpoint as they are served.

============================================  =====================================================
metric                                        meaning
============================================  =====================================================
``deltarec_replica_ready``                    1 once a generation is served
``deltarec_replica_generation``, ``_seq``     the point served
``deltarec_replica_version``                  ``generation << 32 | seq`` of it
``deltarec_replica_pointer_generation``,      the serving pointer followed
``_pointer_seq``
``deltarec_replica_lag_dumps``                committed dumps of the served generation not applied
``deltarec_replica_lag_seconds``              seconds since the oldest of those was taken
``deltarec_replica_blocked``                  1 while a gap, duplicate or bad dump stops it
``deltarec_replica_rows{table}``              keys held per table
``deltarec_replica_applied_dumps_total``      dumps applied
``deltarec_replica_applied_rows_total``       rows of those dumps
``deltarec_replica_apply_seconds_total``      seconds spent applying
``deltarec_replica_freshness_seconds``        training step to visible here, last dump
``deltarec_replica_freshness_p50_seconds``,   over the last dumps kept (VISIBLE_KEPT)
``_p99_seconds``
``deltarec_replica_lookups_total{table}``     ids looked up (HTTP)
``deltarec_replica_lookup_seconds``           histogram of one lookup request
============================================  =====================================================
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from deltarec.serving.follow import Follower
from deltarec.stats import quantile

_LOOKUP_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.25, 1.0)


class _ReplicaCollector(Collector):
    def __init__(self, follower: Follower) -> None:
        self.follower = follower

    def collect(self) -> Iterator[Any]:
        f = self.follower
        st = f.status()
        r = f.replica

        def gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"deltarec_replica_{name}", text, value=value)

        yield gauge("ready", "1 once a generation is served", float(st.ready))
        yield gauge("generation", "The generation served", st.generation)
        yield gauge("seq", "The dump served", st.seq)
        yield gauge("version", "generation << 32 | seq of the point served", st.version)
        ptr = st.pointer or {}
        yield gauge(
            "pointer_generation", "Generation of the serving pointer", ptr.get("generation", 0)
        )
        yield gauge("pointer_seq", "Dump of the serving pointer", ptr.get("seq", 0))
        yield gauge(
            "lag_dumps", "Committed dumps of the served generation not applied", st.lag_dumps
        )
        yield gauge("lag_seconds", "Seconds since the oldest unapplied dump was taken", st.lag_s)
        yield gauge(
            "blocked",
            "1 while a gap, duplicate or bad dump stops the replica",
            float(bool(st.blocked)),
        )
        rows = GaugeMetricFamily("deltarec_replica_rows", "Keys held per table", labels=["table"])
        for table, info in st.tables.items():
            rows.add_metric([table], info["rows"])
        yield rows
        yield CounterMetricFamily(
            "deltarec_replica_applied_dumps", "Dumps applied", value=r.applied_dumps
        )
        yield CounterMetricFamily(
            "deltarec_replica_applied_rows", "Rows of the dumps applied", value=r.applied_rows
        )
        yield CounterMetricFamily(
            "deltarec_replica_apply_seconds", "Seconds spent applying dumps", value=r.apply_seconds
        )
        fresh = sorted(v.freshness_s for v in r.visible if v.freshness_s is not None)
        last = next((v.freshness_s for v in reversed(r.visible) if v.freshness_s is not None), 0.0)
        yield gauge("freshness_seconds", "Training step to visible here, last dump", last or 0.0)
        yield gauge(
            "freshness_p50_seconds",
            "Median training step to visible here",
            quantile(fresh, 0.5) if fresh else 0.0,
        )
        yield gauge(
            "freshness_p99_seconds",
            "p99 training step to visible here",
            quantile(fresh, 0.99) if fresh else 0.0,
        )


class ReplicaMetrics:
    """A replica's metrics in a registry of their own.

    Args:
        follower: the follower whose replica is measured.
    """

    def __init__(self, follower: Follower) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_ReplicaCollector(follower))
        self.lookups = Counter(
            "deltarec_replica_lookups", "Ids looked up", ["table"], registry=self.registry
        )
        self.lookup_seconds = Histogram(
            "deltarec_replica_lookup_seconds",
            "Seconds per lookup request (rows of a batch of ids)",
            buckets=_LOOKUP_BUCKETS,
            registry=self.registry,
        )
        self.refused = Counter(
            "deltarec_replica_requests_refused",
            "Requests answered 4xx/503 before the work: over a bound, malformed, unauthorized",
            ["code"],
            registry=self.registry,
        )


__all__ = ["ReplicaMetrics"]
