"""A read-latency budget for publishing: serving keeps its read latency while a dump lands.

The store a dump is published into is the one serving reads from. Written as fast as it can
go, a generation slows the readers down: Redis runs one ``MULTI``/``EXEC`` at a time, so every
read waits for the batch in flight (a 8 MB batch holds them for about 100 ms); PostgreSQL's
readers compete with the write for CPU, WAL and buffers. With a budget (``--read-p99-ms``,
``DumperConfig.read_p99_ms``, the pipeline's ``read_p99_ms``) the publisher

1. times reads of serving keys the way a serving client makes them, from a probe process of
   its own (:mod:`deltarec.publish.probe`), while it writes;
2. after every transaction, judges the probes' p99 over the last :data:`WINDOW` probes
   against the budget (once :data:`JUDGE` new ones came): over it, the transactions halve
   (down to :data:`MIN_BYTES` or :data:`MIN_UNBLOCKED_BYTES`) and the pause after each
   doubles (a **duty** fraction of the time the transaction took, from :data:`MIN_DUTY` up
   to :data:`MAX_DUTY`, at most :data:`MAX_PAUSE_S`); under :data:`SLACK` of it, the
   transactions grow by :data:`GROW` (up to the store's default size) and the duty halves
   away;
3. into a store whose writes block its reads (``capabilities.writes_block_reads``: Redis),
   sizes the writes by a cap alone (over the budget only the pauses grow: a write below the
   cap would add round trips, not shorten any wait), starts from :data:`MIN_BYTES`, grows by
   :data:`GROW` a write, and never sends a transaction that the time it took per byte
   says would take longer than :data:`CAP_SHARE` of the budget less the probes' median (a
   read's own time). A write's time is what the store says it held the server
   (``last_write_held_s``: Redis, asked to by ``server_timing``, takes ``EXEC``'s time from
   the server), else the whole write call's. The
   time per byte is the slope of time over size of the last :data:`TIMED` transactions (a
   write's round trips hold no reader up; only its bytes hold the server), at most the least
   time per byte of any of them and at least :data:`FASTEST_S_PER_BYTE`;
4. counts the time it paused (:attr:`Throttle.held_back_s`, the metric
   ``deltarec_publish_held_back_seconds_total``) and the probes' last p99; the trainer's
   background publisher also leaves its report beside the generation
   (:func:`record_report`), where verify's KFP metrics find it (:func:`held_back_s`).

Without a budget nothing of this runs: the publisher writes as it always did. The throttle
changes only the publisher's ``batch_bytes`` between transactions and pauses in its
``after_batch`` hook; transactions, progress marks and versions are those of any publish.
"""

from __future__ import annotations

import collections
import json
import logging
import posixpath
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from deltarec.artifacts import ArtifactRoot, codec
from deltarec.errors import ConfigError
from deltarec.publish.probe import Probe, probe_target
from deltarec.stats import quantile
from deltarec.stores.types import ProgressMark

if TYPE_CHECKING:
    from deltarec.publish.publisher import BatchHook, DumpPublisher

log = logging.getLogger(__name__)

WINDOW = 200
"""Probes the p99 is taken over."""
JUDGE = 16
"""New probes before the next judgement (fewer cannot tell a p99 from noise)."""
SLACK = 0.75
"""Under this fraction of the budget the transactions grow again."""
GROW = 1.5
"""How much a transaction grows at a judgement under the budget."""
MIN_BYTES = 4 << 10
"""The smallest transaction into a store whose writes block its reads (about 15 rows of dim
64): the publish always moves on."""
MIN_UNBLOCKED_BYTES = 256 << 10
"""The smallest transaction into any other store (about 900 rows of dim 64): below it a SQL
store spends more on each transaction than on its rows, and its readers are not blocked by
one write but slowed by the sum of them, which the pauses bound."""
START_BYTES = 4 << 20
"""The first transaction into a store whose writes do not block its reads."""
MIN_DUTY = 0.125
"""The first pause after a transaction, as a fraction of the time it took."""
MAX_DUTY = 8.0
"""The longest pause after a transaction, as a multiple of the time it took."""
MAX_PAUSE_S = 0.5
"""The longest pause, whatever the transaction took."""
PROBE_START_S = 10.0
"""How long the first write after the probe started waits for its first reading at most."""
TIMED = 16
"""Transactions whose times give a blocking store's time per byte."""
CAP_SHARE = 0.8
"""The share of the budget (less a read's own time) a blocking store's write may take: the
rest is room for the error of the time per byte."""
FASTEST_S_PER_BYTE = 1e-8
"""The least time per byte a blocking store is taken to need (100 MB/s: about the rate at
which one Redis server thread applies rows of dim 64), whatever the fit says."""
ROW_OVERHEAD = 24
"""Bytes a row counts for besides its encoded values (as the publisher sizes transactions)."""


def check_budget(read_p99_ms: float | None, where: str = "read_p99_ms") -> float | None:
    """``read_p99_ms`` if it is a budget (positive milliseconds) or None.

    Raises:
        ConfigError: zero or negative, naming ``where``.
    """
    if read_p99_ms is not None and not read_p99_ms > 0:
        raise ConfigError(f"{where} must be a positive number of milliseconds, got {read_p99_ms}")
    return read_p99_ms


class ReadBudget:
    """The policy: how big the next transaction is and how long to pause before it.

    Args:
        p99_s: the budget, seconds.
        max_bytes: the largest transaction (the store's default size).
        blocking: the store's writes block its reads (see the module doc, 3).
    """

    def __init__(self, p99_s: float, max_bytes: int, blocking: bool) -> None:
        self.p99_s = p99_s
        self.max_bytes = max(MIN_BYTES, max_bytes)
        self.blocking = blocking
        self.min_bytes = MIN_BYTES if blocking else MIN_UNBLOCKED_BYTES
        self.bytes = MIN_BYTES if blocking else min(self.max_bytes, START_BYTES)
        self.duty = 0.0
        self.last_p99_s: float | None = None
        self.smallest = self.bytes
        self._window: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._fresh = 0
        self._timed: collections.deque[tuple[int, float]] = collections.deque(maxlen=TIMED)

    def step(
        self, nbytes: int, write_s: float, probes: list[float], held_s: float | None = None
    ) -> float:
        """Account for a transaction of ``nbytes`` that took ``write_s``; the pause to make.

        ``probes``: the probe latencies (seconds) that came since the last step. ``held_s``:
        how long the transaction held the server, where the store tells (else ``write_s``).
        """
        timed = write_s if held_s is None else held_s
        if nbytes > 0 and timed > 0:
            self._timed.append((nbytes, timed))
        self._window.extend(probes)
        self._fresh += len(probes)
        if self._fresh >= JUDGE and len(self._window) >= JUDGE:
            self._judge()
        if self.blocking:  # the cap alone sizes a write (see _judge)
            grown = min(self.max_bytes, int(self.bytes * GROW) + 1)
            self.bytes = max(MIN_BYTES, min(grown, self._blocking_cap()))
        self.smallest = min(self.smallest, self.bytes)
        return min(MAX_PAUSE_S, self.duty * max(0.0, write_s))

    def _judge(self) -> None:
        p99 = quantile(sorted(self._window), 0.99)
        self.last_p99_s = p99
        self._fresh = 0
        if p99 > self.p99_s:
            # Where one write holds every read, the cap already bounds each wait; writes smaller
            # than it would only add round trips and marks. Elsewhere a smaller transaction
            # lets the pauses come more often.
            if not self.blocking:
                self.bytes = max(self.min_bytes, self.bytes // 2)
            self.duty = min(MAX_DUTY, max(MIN_DUTY, self.duty * 2))
            self._window.clear()  # judge the next step by what it does alone
        elif p99 < SLACK * self.p99_s:
            self.bytes = min(self.max_bytes, int(self.bytes * GROW) + 1)
            self.duty = 0.0 if self.duty <= MIN_DUTY else self.duty / 2

    def _blocking_cap(self) -> int:
        """The largest transaction the budget allows where a write holds every read."""
        if not self._timed:
            return self.bytes
        own = statistics.median(self._window) if self._window else 0.0
        allowed = max(0.2 * self.p99_s, CAP_SHARE * (self.p99_s - own))
        return int(allowed / self._seconds_per_byte())

    def _seconds_per_byte(self) -> float:
        """What a byte more costs a write: the Theil-Sen slope of time over size of the writes.

        The last :data:`TIMED` writes. A write's time is its round trips plus its bytes; only
        the bytes hold the server (and so the readers). The slope is at most the least time per
        byte of any of the writes (a write's bytes take at most all of its time) and at least
        :data:`FASTEST_S_PER_BYTE`.
        """
        sizes = np.array([b for b, _ in self._timed], np.float64)
        times = np.array([t for _, t in self._timed], np.float64)
        bound = float((times / sizes).min())
        # Theil-Sen: the median slope over pairs of writes of clearly different sizes, so that
        # one write slowed by something else (the first of a part checks its rows) moves it not
        i, j = np.triu_indices(len(sizes), 1)
        apart = sizes[j] > 1.2 * sizes[i]
        apart |= sizes[i] > 1.2 * sizes[j]
        if apart.sum() < 8:
            return bound
        slopes = (times[j] - times[i])[apart] / (sizes[j] - sizes[i])[apart]
        return min(bound, max(FASTEST_S_PER_BYTE, float(np.median(slopes))))


@dataclass
class BudgetReport:
    """What the budget did over a publish (``deltarec publish --json``'s ``budget``)."""

    read_p99_ms: float
    held_back_s: float = 0.0
    probes: int = 0
    probe_p50_ms: float | None = None
    probe_p99_ms: float | None = None
    probe_max_ms: float | None = None
    smallest_batch_bytes: int = 0
    last_batch_bytes: int = 0

    def to_json(self) -> dict[str, object]:
        """A JSON-ready dict."""
        return dict(self.__dict__)


class Throttle:
    """Holds a :class:`DumpPublisher` within a read-latency budget (see the module doc).

    Attaching sets the publisher's ``batch_bytes`` and wraps its ``after_batch`` hook (the
    hook it had is still called); :meth:`close` stops the probe and restores both.

    Args:
        publisher: the publisher to throttle.
        read_p99_ms: the budget: the p99 of reads of serving keys, milliseconds.
        probe_interval_s: seconds between two probe reads.
    """

    def __init__(
        self, publisher: DumpPublisher, read_p99_ms: float, probe_interval_s: float = 0.005
    ) -> None:
        check_budget(read_p99_ms)
        store = publisher.store
        self.publisher = publisher
        self.policy = ReadBudget(
            read_p99_ms / 1000, publisher.batch_bytes, store.capabilities.writes_block_reads
        )
        self.report = BudgetReport(read_p99_ms)
        self.probe_interval_s = probe_interval_s
        self._probe: Probe | None = None
        self._probed = False
        self._latencies: list[float] = []
        self._default_bytes = publisher.batch_bytes
        self._chained: BatchHook | None = publisher.after_batch
        publisher.batch_bytes = self.policy.bytes
        publisher.after_batch = self.after_batch
        self._timing = hasattr(store, "server_timing")  # a store that can time its writes
        if self._timing:
            store.server_timing = True  # type: ignore[attr-defined]
        self._since = time.monotonic()

    @property
    def held_back_s(self) -> float:
        """Seconds the publisher paused for the readers so far."""
        return self.report.held_back_s

    def after_batch(self, mark: ProgressMark, n: int) -> None:
        """The publisher's hook after each committed transaction: judge, resize, pause."""
        write_s = time.monotonic() - self._since
        self._start_probe(mark.table)
        probes = self._probe.take() if self._probe is not None else []
        self._latencies.extend(probes)
        spec = self.publisher.generation_info(mark.generation).tables[mark.table]
        unit = codec.row_bytes(spec.dtype, spec.dim) + ROW_OVERHEAD
        held = getattr(self.publisher.store, "last_write_held_s", None)
        pause = self.policy.step(n * unit, write_s, probes, held)
        self.publisher.batch_bytes = self.policy.bytes
        metrics = self.publisher.metrics
        if self.policy.last_p99_s is not None:
            metrics.read_probe_p99.set(self.policy.last_p99_s)
        if pause > 0:
            time.sleep(pause)
            self.report.held_back_s += pause
            metrics.held_back.inc(pause)
        if self._chained is not None:
            self._chained(mark, n)
        self._since = time.monotonic()

    def _start_probe(self, table: str) -> None:
        """Start the probe on the serving name of the first table written (once)."""
        if self._probed:
            return
        self._probed = True
        target = probe_target(self.publisher.store, table)
        if target is None:
            log.warning(
                "read budget: %s cannot be probed; only the write-time cap applies",
                self.publisher.store.describe(),
            )
            return
        self._probe = Probe(target, self.probe_interval_s)
        self._probe.wait_first(PROBE_START_S)  # the readers' latency before the next write

    def close(self) -> BudgetReport:
        """Stop the probe, restore the publisher, and say what the budget did (idempotent)."""
        if self._probe is not None:
            self._latencies.extend(self._probe.take())
            self._probe.close()
            self._probe = None
        if self.publisher.after_batch == self.after_batch:
            self.publisher.after_batch = self._chained
            self.publisher.batch_bytes = self._default_bytes
            if self._timing:
                self.publisher.store.server_timing = False  # type: ignore[attr-defined]
        r = self.report
        r.probes = len(self._latencies)
        if self._latencies:
            ordered = sorted(self._latencies)
            r.probe_p50_ms = round(quantile(ordered, 0.5) * 1000, 3)
            r.probe_p99_ms = round(quantile(ordered, 0.99) * 1000, 3)
            r.probe_max_ms = round(ordered[-1] * 1000, 3)
        r.smallest_batch_bytes = self.policy.smallest
        r.last_batch_bytes = self.policy.bytes
        r.held_back_s = round(r.held_back_s, 3)
        return r

    def __enter__(self) -> Throttle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def throttled(publisher: DumpPublisher, read_p99_ms: float | None) -> Throttle | None:
    """A :class:`Throttle` of ``publisher`` when a budget is given, else None (no change)."""
    if check_budget(read_p99_ms) is None:
        return None
    assert read_p99_ms is not None
    return Throttle(publisher, read_p99_ms)


def report_path(root: ArtifactRoot, run: str, generation: int, rank: int) -> str:
    """Where a rank's background publisher leaves its budget's report: ``gen-<G>/budget/``."""
    return posixpath.join(root.gen_dir(run, generation), "budget", f"rank-{rank}.json")


def record_report(
    root: ArtifactRoot, run: str, generation: int, rank: int, report: BudgetReport
) -> None:
    """Leave ``report`` beside ``generation`` for rank ``rank`` (replacing an earlier one)."""
    path = report_path(root, run, generation, rank)
    root.write_bytes_atomic(path, json.dumps(report.to_json(), indent=1).encode())


def held_back_s(root: ArtifactRoot, run: str, generation: int) -> float | None:
    """Seconds the ranks' publishers of ``generation`` held back in all; None: no budget ran."""
    folder = posixpath.dirname(report_path(root, run, generation, 0))
    if not root.exists(folder):
        return None
    names = [n for n in root.fs.ls(folder, detail=False) if str(n).endswith(".json")]
    return sum(float(root.read_json(str(n))["held_back_s"]) for n in names)
