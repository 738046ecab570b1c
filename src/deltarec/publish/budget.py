"""A read-latency budget for publishing: serving keeps its read latency while a dump lands.

The store a dump is published into is the one serving reads from. Written as fast as it can
go, a generation slows the readers down: Redis runs one command or ``MULTI``/``EXEC`` at a
time, so every read waits for the write in flight; PostgreSQL's readers compete with the write
for CPU, WAL and buffers. With a budget (``--read-p99-ms``, ``DumperConfig.read_p99_ms``, the
pipeline's ``read_p99_ms``) the publisher

1. times reads of serving keys the way a serving client makes them, from a probe process of
   its own (:mod:`deltarec.publish.probe`), while it writes and while it pauses: the probes
   made while a transaction was written judge the write; those made while nothing was written
   (before the first write, during the pauses) measure the machine's own **noise**;
2. judges the p99 of the last :data:`WINDOW` probes made during writes (once :data:`JUDGE` new
   ones came; a slow probe or two cannot move a p99 of that many; over the target only if the
   new ones' p99 is too, so the probes from before the last change do not count twice)
   against the **target**: the
   budget, raised by as much as the noise's p99 exceeds half the budget (reads slowed by other
   work on the machine are not slowed by the write, and writing less cannot remove that);
3. over the target, pauses after each transaction for a **duty** fraction of the time it took,
   raised in proportion to the excess (at most :data:`MAX_STEP` times a judgement, from
   :data:`MIN_DUTY` up to :data:`MAX_DUTY`, a pause at most :data:`MAX_PAUSE_S`); under
   :data:`SLACK` of it, lowers the duty in proportion (to nothing below :data:`MIN_DUTY`).
   Into a store whose writes block its reads the units shrink first and the pauses only
   dilute (below);
4. into a store whose writes block its reads (``capabilities.writes_block_reads``: Redis)
   sizes what the server runs at once by the server's own time per row (the median of the
   last :data:`TIMED` writes, ``last_write_held_s`` over their rows where the store tells,
   asked to by ``server_timing``): a unit never holds the server longer than a **share**
   (:data:`UNIT_SHARE` at first) of the budget (not the target: the noise adds to a unit's
   wait) less a read's own time (the probes' median). Over the target the share falls in
   proportion to the excess (at most :data:`MAX_STEP` a judgement, down to
   :data:`MIN_UNIT_SHARE`) before any pause is made: a read that arrives while a unit runs
   waits for what is left of it, so the readers' p99 follows the unit's length, and pausing
   between units, which only makes fewer reads wait as long, barely moves it while it costs
   the publish its rate (bench/results/readers.md run 17, before this rule: 2.3-3.6 s of
   pauses in a 14 s publish, the rate 0.43x of an unthrottled one). They shrink only while
   they can explain the excess (the p99 within :data:`EXPLAINS` units' time of the probes'
   median); reads slower than that wait for something else (on 2 cores, for a CPU), which
   smaller units only make worse by their own cost: there the units grow back (run 19:
   units at their floor and full pauses gave 0.25x). Only units at their floor (the share at
   :data:`MIN_UNIT_SHARE` or :data:`MIN_UNIT_ROWS` rows), or units that cannot explain the
   excess, pause, and only as long as **dilutes** the writes' slow reads to a p99: a pause
   makes no read during a write faster, it only adds reads that nothing slows, so with a
   fraction ``over`` of the writes' probes over the target the duty is ``over / 1% - 1``
   (:meth:`ReadBudget._diluting_duty`), and none where that is more than :data:`FUTILE`
   times :data:`MAX_DUTY` (no pause the publisher makes would bring the p99 within; on
   2 cores the pauses of the rule before this one moved no p99 and cost 35-45 % of the
   rate, bench/results/readers.md run 23). Once the writes' own p99 is within the target the
   pause goes; under :data:`SLACK` of it the share grows back (to :data:`UNIT_SHARE` at
   most). A store with
   units (``unit_rows``: Redis writes a batch in small units, each a transaction or a script
   of its own, that reads interleave with, :mod:`deltarec.stores.redis.paced`) gets that many
   rows a unit and
   transactions of :data:`UNIT_TXN_BYTES`; any other gets transactions that small;
5. into any other store, starts from :data:`START_BYTES` transactions, then sizes each to
   :data:`TXN_S` of writing at the rate of the last :data:`TIMED` (their median; at least
   :data:`MIN_UNBLOCKED_BYTES`, at most the store's default size): the pauses come that often,
   and a transaction stays large enough that its own cost is small beside its rows' (smaller
   ones do not slow a reader less, they only cost more work per row);
6. counts the time it paused (:attr:`Throttle.held_back_s`, the metric
   ``deltarec_publish_held_back_seconds_total``) and the probes' last p99; the trainer's
   background publisher also leaves its report beside the generation
   (:func:`~deltarec.publish.budgetreport.record_report`), where verify's KFP metrics find it
   (:func:`~deltarec.publish.budgetreport.held_back_s`);
7. unless told not to (``yield_cpu``), puts the thread that publishes, and the threads it
   starts, at the lowest CPU priority (:mod:`deltarec.publish.yieldcpu`), the probe process
   started before it lowers (when the throttle attaches, aimed at the first table written).

Without a budget nothing of this runs: the publisher writes as it always did. The throttle
changes only the publisher's ``batch_bytes`` and the store's ``unit_rows`` between
transactions, and pauses in the publisher's ``after_batch`` hook; progress marks and versions
are those of any publish.
"""

from __future__ import annotations

import collections
import logging
import statistics
import threading
import time
from typing import TYPE_CHECKING

from deltarec.artifacts import codec
from deltarec.errors import ConfigError
from deltarec.publish import yieldcpu
from deltarec.publish.budgetreport import BudgetReport
from deltarec.publish.probe import Probe, probe_target
from deltarec.stats import quantile
from deltarec.stores.types import ProgressMark, Write

if TYPE_CHECKING:
    from deltarec.publish.face import BatchHook
    from deltarec.publish.publisher import DumpPublisher

log = logging.getLogger(__name__)

WINDOW = 256
"""Probes made during writes that the p99 is taken over (a p99 of 256: the 3rd-4th largest)."""
JUDGE = 64
"""New probes made during writes before the next judgement."""
QUIET = 256
"""Probes made while nothing was written that the noise's p99 is taken over."""
MIN_QUIET = 32
"""Fewer quiet probes than this tell no noise (the target is then the budget)."""
BASELINE_PROBES = 100
"""Quiet probes the throttle waits for before the second write (the noise before any pause;
about half a second, counted as held back)."""
SLACK = 0.75
"""Under this fraction of the target the pauses shrink."""
MAX_STEP = 2.0
"""The most one judgement multiplies the pause by."""
MIN_BYTES = 4 << 10
"""The smallest transaction into a store whose writes block its reads and that has no units."""
MIN_UNBLOCKED_BYTES = 256 << 10
"""The smallest transaction into any other store (about 900 rows of dim 64): below it a SQL
store spends more on each transaction than on its rows."""
START_BYTES = 4 << 20
"""The first transaction into a store whose writes do not block its reads."""
TXN_S = 0.25
"""What a transaction into such a store takes at the rate measured: a judgement and a pause
after each quarter of a second, not after seconds of writing."""
UNIT_TXN_BYTES = 4 << 20
"""A transaction into a store with units (each a progress mark and a judgement)."""
UNIT_SHARE = 0.5
"""The share of the budget (less a read's own time) one server-side unit may take at most."""
MIN_UNIT_SHARE = UNIT_SHARE / 8
"""The least share: below it a unit's own cost (a script call) outweighs its rows'."""
EXPLAINS = 3.0
"""Units of this many times a unit's server time, above the probes' median, are what a
p99 over the target can owe to the units (:meth:`ReadBudget._units_explain`)."""
MIN_UNIT_ROWS = 8
"""The fewest rows of a unit (or a blocking store's transaction): the publish always moves on."""
MAX_UNIT_ROWS = 1000
"""The most rows of a unit."""
START_UNIT_ROWS = 16
"""A unit's rows before the server's time per row is known."""
MIN_DUTY = 0.125
"""The first pause after a transaction, as a fraction of the time it took."""
MAX_DUTY = 1.0
"""The longest pause after a transaction, as a multiple of the time it took: the publisher
never pauses longer than it writes, so a budget that the machine's own load makes
unattainable costs at most about half the publish rate (8 let it fall to 0.25 of it on a
loaded machine, bench/results/readers.md run 9)."""
MAX_PAUSE_S = 0.5
"""The longest pause, whatever the transaction took."""
FUTILE = 2.0
"""Into a blocking store, pauses that would have to be this many times :data:`MAX_DUTY` to
dilute the writes' slow reads to a p99 are not made (:meth:`ReadBudget._diluting_duty`)."""
PROBE_START_S = 10.0
"""How long the first write after the probe started waits for its baseline at most."""
TIMED = 16
"""Writes whose server time per row gives a blocking store's (their median)."""
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


def _p99(window: collections.deque[float]) -> float:
    return quantile(sorted(window), 0.99)


class ReadBudget:
    """The policy: how big the next transaction (and unit) is and how long to pause before it.

    Args:
        p99_s: the budget, seconds.
        max_bytes: the largest transaction (the store's default size).
        blocking: the store's writes block its reads (see the module doc, 4).
        units: the store writes in server-side units of :attr:`unit_rows` rows.
    """

    def __init__(self, p99_s: float, max_bytes: int, blocking: bool, units: bool = False) -> None:
        self.p99_s = p99_s
        self.max_bytes = max(MIN_BYTES, max_bytes)
        self.blocking = blocking
        self.unit_rows: int | None = START_UNIT_ROWS if blocking and units else None
        if self.unit_rows is not None:
            self.bytes = min(self.max_bytes, UNIT_TXN_BYTES)
        elif blocking:
            self.bytes = MIN_BYTES
        else:
            self.bytes = min(self.max_bytes, START_BYTES)
        self.duty = 0.0
        self.share = UNIT_SHARE
        self.futile = 0
        """Judgements of a blocking store where no pause could dilute the slow reads enough."""
        self.last_p99_s: float | None = None
        self.smallest = self.bytes
        self.smallest_unit = self.unit_rows
        self._during: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._quiet: collections.deque[float] = collections.deque(maxlen=QUIET)
        self._fresh = 0
        self._per_row: collections.deque[float] = collections.deque(maxlen=TIMED)
        self._row_bytes = 0.0

    def noise_s(self) -> float | None:
        """The p99 of the probes made while nothing was written (None: too few yet)."""
        return _p99(self._quiet) if len(self._quiet) >= MIN_QUIET else None

    def window_p99_s(self) -> float | None:
        """The p99 of the window of probes made during writes (None: none yet)."""
        return _p99(self._during) if self._during else None

    def target_s(self) -> float:
        """The p99 the writes are held to: the budget, raised by the noise (module doc, 2)."""
        noise = self.noise_s()
        return self.p99_s if noise is None else self.p99_s + max(0.0, noise - self.p99_s / 2)

    def step(
        self,
        rows: int,
        nbytes: int,
        write_s: float,
        during: list[float],
        quiet: list[float] = (),  # type: ignore[assignment]
        held_s: float | None = None,
    ) -> float:
        """Account for a transaction of ``rows`` rows (``nbytes``) that took ``write_s``.

        ``during``: probe latencies (seconds) timed while it was written; ``quiet``: those timed
        while nothing was (since the last step). ``held_s``: how long it held the server, where
        the store tells. Returns the pause to make.
        """
        if rows > 0 and write_s > 0:
            self._row_bytes = nbytes / rows
            self._per_row.append((write_s if held_s is None else held_s) / rows)
        self._quiet.extend(quiet)
        self._during.extend(during)
        self._fresh += len(during)
        if self._fresh >= JUDGE and len(self._during) >= JUDGE:
            self._judge()
        if self.blocking:
            self._size_blocking()
        elif self._per_row:
            timed = int(TXN_S / max(1e-9, statistics.median(self._per_row)) * self._row_bytes)
            self.bytes = max(MIN_UNBLOCKED_BYTES, min(self.max_bytes, timed))
        self.smallest = min(self.smallest, self.bytes)
        if self.unit_rows is not None:
            self.smallest_unit = min(self.smallest_unit or self.unit_rows, self.unit_rows)
        return min(MAX_PAUSE_S, self.duty * max(0.0, write_s))

    def _judge(self) -> None:
        """Judge the window; over the target only if the new probes' p99 is over it too.

        The probes from before the last change, still in the window, do not raise the pause
        again.
        """
        p99 = _p99(self._during)
        fresh = quantile(sorted(list(self._during)[-self._fresh :]), 0.99)
        self.last_p99_s = p99
        self._fresh = 0
        target = self.target_s()
        ratio = min(p99, fresh) / target
        if self.blocking:
            self._judge_blocking(p99, min(p99, fresh), target)
        elif ratio > 1:
            self.duty = min(MAX_DUTY, max(MIN_DUTY, self.duty) * min(MAX_STEP, ratio))
        elif p99 < SLACK * target and self.duty > 0:
            self.duty *= max(1 / MAX_STEP, p99 / target / SLACK)
            if self.duty < MIN_DUTY:
                self.duty = 0.0

    def _judge_blocking(self, p99: float, judged: float, target: float) -> None:
        """A blocking store's judgement (module doc, 4): units first, then pauses that dilute.

        ``p99``: the window's; ``judged``: the lower of it and the new probes' p99.
        """
        if judged > target:
            explained = self._units_explain(judged)
            if explained and self._units_can_shrink():
                self.share = max(MIN_UNIT_SHARE, self.share / min(MAX_STEP, judged / target))
                return
            if not explained:  # smaller units would only cost
                self.share = min(UNIT_SHARE, self.share * MAX_STEP)
            self.duty = self._diluting_duty(target)
        elif self.duty > 0:  # the writes' own reads are within the target: nothing to dilute
            self.duty = 0.0
        elif p99 < SLACK * target:
            self.share = min(UNIT_SHARE, self.share * min(MAX_STEP, SLACK * target / p99))

    def _diluting_duty(self, target: float) -> float:
        """The pause, as a fraction of the write, that dilutes the writes' slow reads to 1 %.

        A pause between two writes of a blocking store makes no read of the writes faster; it
        only adds reads that no write slows. With a fraction ``over`` of the probes made during
        writes over the target, a duty ``d`` leaves ``over / (1 + d)`` of all reads over it:
        within a p99 from ``d = over / 1 % - 1``. Where that is more than :data:`FUTILE` times
        :data:`MAX_DUTY`, no pause the publisher makes brings the readers' p99 within the
        target: it does not pause (on 2 cores the pauses moved no p99 and cost 35-45 % of the
        rate: bench/results/readers.md run 23), and counts the judgement in :attr:`futile`.
        """
        over = sum(1 for x in self._during if x > target) / max(1, len(self._during))
        needed = over / (1 - 0.99) - 1
        if needed <= 0:
            return 0.0
        if needed > FUTILE * MAX_DUTY:
            self.futile += 1
            return 0.0
        return min(MAX_DUTY, max(MIN_DUTY, needed))

    def _read_s(self) -> float:
        """A read's own time: the median of the probes in the windows (0 before any)."""
        probes = list(self._during) + list(self._quiet)
        return statistics.median(probes) if probes else 0.0

    def _units_explain(self, p99: float) -> bool:
        """Whether the units' length can explain a p99 of ``p99`` (module doc, 4).

        A read waits for what is left of the unit in flight (and the append of its rows to
        the server's file after it): what a unit adds is within :data:`EXPLAINS` units'
        time. Reads slower than that above the probes' median wait for something else (on
        2 cores, for a CPU: bench/results/readers.md runs 15 and 19).
        """
        if not self._per_row:
            return False
        rows = self.unit_rows if self.unit_rows is not None else self.bytes / self._row_bytes
        unit_s = rows * statistics.median(self._per_row)
        own = self._read_s()
        return p99 - own <= EXPLAINS * unit_s

    def _units_can_shrink(self) -> bool:
        """Whether a blocking store's units are above their floor (module doc, 4)."""
        if not self._per_row or self.share <= MIN_UNIT_SHARE:
            return False
        if self.unit_rows is not None:
            return self.unit_rows > MIN_UNIT_ROWS
        return self.bytes > MIN_BYTES

    def _size_blocking(self) -> None:
        """A unit (or transaction) the server runs within its share of the budget.

        The budget, not the target: a unit's wait adds to whatever else slows a read, so the
        noise that raises the target does not make the units longer.
        """
        if not self._per_row:
            return
        own = self._read_s()
        allowed = self.share * max(0.2 * self.p99_s, self.p99_s - own)
        rows = int(allowed / max(1e-9, statistics.median(self._per_row)))
        rows = max(MIN_UNIT_ROWS, min(MAX_UNIT_ROWS, rows))
        if self.unit_rows is not None:
            self.unit_rows = rows
        else:
            nbytes = int(rows * self._row_bytes) if self._row_bytes else self.bytes
            self.bytes = max(MIN_BYTES, min(self.max_bytes, nbytes))


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


class Throttle:
    """Holds a :class:`DumpPublisher` within a read-latency budget (see the module doc).

    Attaching sets the publisher's ``batch_bytes`` (and the store's ``unit_rows``, where it
    has them), wraps its ``after_batch`` hook (the hook it had is still called) and times the
    store's ``apply`` (when each transaction's write starts: what comes before, such as the
    time between two dumps, is no write); :meth:`close` stops the probe and restores them.

    Args:
        publisher: the publisher to throttle.
        read_p99_ms: the budget: the p99 of reads of serving keys, milliseconds.
        probe_interval_s: seconds between two probe reads.
        yield_cpu: the calling thread, which publishes, and the threads it starts from now on
            run at the lowest CPU priority until :meth:`close` (:mod:`deltarec.publish.yieldcpu`).
    """

    def __init__(
        self,
        publisher: DumpPublisher,
        read_p99_ms: float,
        probe_interval_s: float = 0.005,
        yield_cpu: bool = True,
    ) -> None:
        check_budget(read_p99_ms)
        store = publisher.store
        self.publisher = publisher
        self._units = hasattr(store, "unit_rows")
        self.policy = ReadBudget(
            read_p99_ms / 1000,
            publisher.batch_bytes,
            store.capabilities.writes_block_reads,
            self._units,
        )
        self.report = BudgetReport(read_p99_ms)
        self._probe: Probe | None = None
        self._probed = False
        self._baseline_pending = False
        self._latencies: list[float] = []
        self._default_bytes = publisher.batch_bytes
        self._chained: BatchHook | None = publisher.after_batch
        publisher.after_batch = self.after_batch
        self._apply_sizes()
        # when a transaction's write starts: the store's apply, timed (idle time between two
        # dumps, or the publisher's own work before a write, is no write)
        self._inner_apply = store.apply
        self._write_start: float | None = None
        store.apply = self._timed_apply  # type: ignore[method-assign]
        note = getattr(store, "read_stall_note", None)  # what no pause or unit size can hold
        why = note() if note is not None else None
        if why:
            log.warning("read budget: %s: %s", store.describe(), why)
        self._timing = hasattr(store, "server_timing")  # a store that can time its writes
        if self._timing:
            store.server_timing = True  # type: ignore[attr-defined]
        # the probe starts now, at the priority serving has (before this thread lowers) and
        # while the publisher starts; it is aimed at the first table written
        target = probe_target(store, None)
        if target is None:
            log.warning(
                "read budget: %s cannot be probed; only the write-time cap applies",
                store.describe(),
            )
        else:
            self._probe = Probe(target, probe_interval_s)
        self._lowered: tuple[int, yieldcpu.Priority] | None = None
        if yield_cpu:
            former = yieldcpu.lower()
            if former is not None:
                self._lowered = (threading.get_native_id(), former)
        self._since = time.monotonic()

    @property
    def held_back_s(self) -> float:
        """Seconds the publisher paused for the readers so far."""
        return self.report.held_back_s

    def _apply_sizes(self) -> None:
        self.publisher.batch_bytes = self.policy.bytes
        if self._units:
            self.publisher.store.unit_rows = self.policy.unit_rows  # type: ignore[attr-defined]

    def _timed_apply(self, write: Write) -> int:
        if self._write_start is None:
            if not self._probed:
                self._start_probe(write[0])  # the first write: the noise before it, first
            self._write_start = time.monotonic()
        return self._inner_apply(write)

    def after_batch(self, mark: ProgressMark, n: int) -> None:
        """The publisher's hook after each committed transaction: judge, resize, pause."""
        start = self._since if self._write_start is None else max(self._since, self._write_start)
        self._write_start = None
        write_s = time.monotonic() - start
        if self._baseline_after_write():
            start = self._since  # every read so far was made after the write
        timed = self._probe.take() if self._probe is not None else []
        during = [lat for at, lat in timed if at >= start]
        quiet = [lat for at, lat in timed if at < start]
        self._latencies += during + quiet
        spec = self.publisher.generation_info(mark.generation).tables[mark.table]
        unit = codec.row_bytes(spec.dtype, spec.dim) + ROW_OVERHEAD
        held = getattr(self.publisher.store, "last_write_held_s", None)
        futile = self.policy.futile
        pause = self.policy.step(n, n * unit, write_s, during, quiet, held)
        if self.policy.futile and not futile:
            log.warning(
                "read budget: the reads during the writes into %s are over the target of "
                "%.3f ms too often for pauses to dilute them (p99 %.3f ms); writing on without "
                "pauses, in units of %s rows",
                self.publisher.store.describe(),
                self.policy.target_s() * 1000,
                (self.policy.last_p99_s or 0.0) * 1000,
                self.policy.unit_rows,
            )
        self.report.writing_s += write_s
        self.report.transactions += 1
        if held is not None:
            self.report.server_s = (self.report.server_s or 0.0) + held
        self._apply_sizes()
        metrics = self.publisher.metrics
        window = self.policy.window_p99_s()
        if window is not None:
            metrics.read_probe_p99.set(window)
        if pause > 0:
            time.sleep(pause)
            self.report.held_back_s += pause
            metrics.held_back.inc(pause)
        if self._chained is not None:
            self._chained(mark, n)
        self._since = time.monotonic()

    def _start_probe(self, table: str) -> None:
        """Aim the probe at the serving name of the first table written (once).

        Then wait for :data:`BASELINE_PROBES` reads before that first write: the noise
        before anything is written (counted as held back). Taken after the first write, it
        held what that write left the machine doing (the server's append to its file, the
        publisher's next reads), and with few pauses after it there is little other quiet
        time to outweigh that: on 2 cores it measured 1.7-3.9 ms against reads of 0.4 ms
        idle, and the target rose with it. A name with no key yet (a first publish) has
        nothing to read: its baseline is taken after the first write
        (:meth:`_baseline_after_write`).
        """
        self._probed = True
        if self._probe is None:
            return
        target = probe_target(self.publisher.store, table)
        assert target is not None  # the store had one without a table
        self._probe.aim(target.name)
        self._baseline_pending = not self._wait_baseline()

    def _wait_baseline(self, if_empty: bool = False) -> bool:
        """Wait for the baseline's probes (held back); whether they came."""
        assert self._probe is not None
        started = time.monotonic()
        got = self._probe.wait_first(PROBE_START_S, BASELINE_PROBES, if_empty)
        self._since = time.monotonic()  # the reads so far were made with nothing written
        self.report.held_back_s += self._since - started
        self.publisher.metrics.held_back.inc(self._since - started)
        return got

    def _baseline_after_write(self) -> bool:
        """The baseline a name empty before the first write gets after it; whether now."""
        if not self._baseline_pending:
            return False
        self._baseline_pending = False
        assert self._probe is not None
        self._probe.resample()
        self._wait_baseline(if_empty=True)  # rows were written: it will find some
        return True

    def close(self) -> BudgetReport:
        """Stop the probe, restore the publisher, and say what the budget did (idempotent)."""
        if self._probe is not None:
            self._latencies.extend(lat for _, lat in self._probe.take())
            self._probe.close()
            self._probe = None
        if self._lowered is not None:
            yieldcpu.restore(*self._lowered)
            self._lowered = None
        if self.publisher.after_batch == self.after_batch:
            vars(self.publisher.store).pop("apply", None)  # the store's own again
            self.publisher.after_batch = self._chained
            self.publisher.batch_bytes = self._default_bytes
            if self._units:
                self.publisher.store.unit_rows = None  # type: ignore[attr-defined]
            if self._timing:
                self.publisher.store.server_timing = False  # type: ignore[attr-defined]
        r = self.report
        r.probes = len(self._latencies)
        if self._latencies:
            ordered = sorted(self._latencies)
            r.probe_p50_ms = _ms(quantile(ordered, 0.5))
            r.probe_p99_ms = _ms(quantile(ordered, 0.99))
            r.probe_max_ms = _ms(ordered[-1])
        r.noise_p99_ms = _ms(self.policy.noise_s())
        r.target_p99_ms = _ms(self.policy.target_s())
        r.smallest_batch_bytes = self.policy.smallest
        r.last_batch_bytes = self.policy.bytes
        r.smallest_unit_rows = self.policy.smallest_unit
        r.futile_judgements = self.policy.futile
        r.last_unit_rows = self.policy.unit_rows
        r.held_back_s = round(r.held_back_s, 3)
        r.writing_s = round(r.writing_s, 3)
        r.server_s = None if r.server_s is None else round(r.server_s, 3)
        return r

    def __enter__(self) -> Throttle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def throttled(
    publisher: DumpPublisher, read_p99_ms: float | None, yield_cpu: bool = True
) -> Throttle | None:
    """A :class:`Throttle` of ``publisher`` when a budget is given, else None (no change).

    Call it on the thread that publishes: with ``yield_cpu`` that thread is lowered.
    """
    if check_budget(read_p99_ms) is None:
        return None
    assert read_p99_ms is not None
    return Throttle(publisher, read_p99_ms, yield_cpu=yield_cpu)
