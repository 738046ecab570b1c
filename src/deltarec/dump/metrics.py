"""Prometheus metrics of the dump path: staging buffers, the host budget, training-thread holds.

:class:`DumpCollector` reads a :class:`~deltarec.dump.dumper.Dumper`'s counters when it is
scraped (nothing on the training thread updates a metric). The trainer registers it beside
the background publisher's metrics (``make_train_hook(metrics_port=...)``), so one endpoint per
rank serves both.

Exported:

* ``deltarec_dump_device_staging_full_total``: tables that did not fit in the device staging
  buffer and were gathered into host memory instead (the training thread then waits for host
  budget, as it did before device staging). A rising count means the buffer is too small: raise
  ``device_staging_share`` or dump more often.
* ``deltarec_dump_device_staged_total``, ``deltarec_dump_device_staging_bytes`` (held now),
  ``deltarec_dump_device_staging_peak_bytes``, ``deltarec_dump_device_staging_capacity_bytes``.
* ``deltarec_dump_device_graphed_total``: dumps of a device's tables gathered by one CUDA graph
  replay (docs/dump.md, *Graphed dumps*); ``deltarec_dump_device_graph_misses_total``: dumps
  that took the exact path instead (more ids than the graphs hold, or both buffer sets busy);
  ``deltarec_dump_device_graph_bytes``: device bytes of the graphs' buffers.
* ``deltarec_dump_host_budget_bytes`` (the configured host budget),
  ``deltarec_dump_host_held_bytes`` (held now) and ``deltarec_dump_host_peak_bytes``.
* ``deltarec_dump_train_waits_total`` / ``deltarec_dump_train_wait_seconds_total``: times and
  seconds the training thread waited for host budget.
* ``deltarec_dump_last_hold_seconds``: seconds the training thread spent in the last dump.
* ``deltarec_dumps_total``: dumps taken by this rank.
* With spread dumps (``spread_steps``, docs/dump.md): ``deltarec_dump_spread_total`` (dumps
  read over the steps after them), ``deltarec_dump_spread_finished_early_total`` (of those,
  the ones whose rest the training thread read at once: the next dump or a checkpoint came
  first; a rising count means dumps come too often for the window), and the last completed
  window's ``deltarec_dump_spread_last_window_steps`` and ``..._seconds`` (a spread dump is
  committed only after its window: its rows become visible that much later).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deltarec.tracking.groups import graph_metrics

if TYPE_CHECKING:
    from deltarec.dump.dumper import Dumper


class DumpCollector(Collector):
    """Collects one dumper's staging, budget and hold counters at scrape time.

    Args:
        dumper: the dumper to read (its counters are read under their own locks).
    """

    def __init__(self, dumper: Dumper) -> None:
        self.dumper = dumper

    def collect(self) -> Iterator[Metric]:
        """The current values (called by ``prometheus_client`` on each scrape)."""
        d = self.dumper
        staging = d.device_budget.metrics()
        graphs = graph_metrics(d.sources)
        queue = d.queue

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        yield counter(
            "deltarec_dump_device_staging_full",
            "Tables that did not fit in the device staging buffer and were gathered into host "
            "memory instead",
            staging["full"],
        )
        yield counter(
            "deltarec_dump_device_staged",
            "Tables gathered into the device staging buffer",
            staging["staged"],
        )
        yield gauge(
            "deltarec_dump_device_staging_bytes",
            "Bytes of the device staging buffer held now",
            staging["held_bytes"],
        )
        yield gauge(
            "deltarec_dump_device_staging_peak_bytes",
            "The most bytes the device staging buffer ever held",
            staging["peak_bytes"],
        )
        yield gauge(
            "deltarec_dump_device_staging_capacity_bytes",
            "Capacity of the device staging buffer (summed over devices measured so far)",
            staging["capacity_bytes"],
        )
        yield counter(
            "deltarec_dump_device_graphed",
            "Dumps of a device's tables gathered by one CUDA graph replay",
            graphs["graphed"],
        )
        yield counter(
            "deltarec_dump_device_graph_misses",
            "Dumps of a device's tables that took the exact path instead of the graph",
            graphs["graph_misses"],
        )
        yield gauge(
            "deltarec_dump_device_graph_bytes",
            "Device bytes of the dump graphs' buffers",
            graphs["graph_bytes"],
        )
        yield gauge(
            "deltarec_dump_host_budget_bytes",
            "The configured host staging budget",
            d.host_budget,
        )
        yield gauge(
            "deltarec_dump_host_held_bytes",
            "Bytes of the host budget held now (rows copied from the tables and their "
            "encoded pieces, until written)",
            queue.outstanding_bytes,
        )
        yield gauge(
            "deltarec_dump_host_peak_bytes",
            "The most bytes of the host budget ever held",
            queue.peak_bytes,
        )
        yield counter(
            "deltarec_dump_train_waits",
            "Times the training thread waited for host budget",
            queue.blocked_puts,
        )
        yield counter(
            "deltarec_dump_train_wait_seconds",
            "Seconds the training thread waited for host budget",
            queue.blocked_seconds,
        )
        held = d.dump_seconds
        yield gauge(
            "deltarec_dump_last_hold_seconds",
            "What the last dump cost the training thread, in seconds (with CUDA: CUDA-event "
            "time of the dump's own work on the training stream)",
            held[-1] if held else 0.0,
        )
        yield counter("deltarec_dumps", "Dumps taken by this rank", d.dumps_taken)
        spread = d.spread
        yield counter("deltarec_dump_spread", "Dumps read over the steps after them", spread.opened)
        yield counter(
            "deltarec_dump_spread_finished_early",
            "Spread dumps whose rows left the training thread read at once",
            spread.finished_early,
        )
        steps, seconds = spread.last_window or (0, 0.0)
        yield gauge(
            "deltarec_dump_spread_last_window_steps",
            "Training steps the last completed spread dump was read over",
            steps,
        )
        yield gauge(
            "deltarec_dump_spread_last_window_seconds",
            "Seconds the last completed spread dump's window was open",
            seconds,
        )
