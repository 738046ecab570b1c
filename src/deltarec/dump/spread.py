"""The dumper's open spread dump: its rows read over the steps after it, then its end queued.

With ``DumperConfig.spread_steps`` a dump of CUDA tables that the group's graph does not take
is not gathered at its step: each group's pending rows are read over the following steps
(:mod:`deltarec.tracking.spread`, copy on write). The dump's :class:`EndOfDump` is queued once
every group has read them all, so the worker commits the dump only then, with every row's
value at the dump step. One spread dump is open at a time: the next dump, a checkpoint's wait
and the end of training read what is left first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from deltarec.dump.queue import ByteBoundedQueue
from deltarec.dump.worker import Chunk, EndOfDump
from deltarec.tracking.gather import DeviceRows
from deltarec.tracking.groups import spread_windows
from deltarec.tracking.spread import SpreadWindow
from deltarec.tracking.types import TableSource

log = logging.getLogger(__name__)


class SpreadDumps:
    """Drives the open spread dump's windows from the training thread.

    Args:
        queue: the dumper's queue to the worker.
    """

    def __init__(self, queue: ByteBoundedQueue) -> None:
        self.queue = queue
        self.windows: list[tuple[SpreadWindow, list[str]]] = []
        self.end: EndOfDump | None = None
        self.opened = 0
        """Dumps that were spread (for metrics and benchmarks)."""
        self.finished_early = 0
        """Spread dumps whose rows left were read at once, on the training thread (the next
        dump, a checkpoint's wait or the end came before their window had read them)."""
        self.last_window: tuple[int, float] | None = None
        """The last completed window: training steps it was read over, seconds it was open."""
        self._steps = 0
        self._since = 0.0

    @property
    def open(self) -> bool:
        """Whether a dump's rows are still being read."""
        return self.end is not None

    def start(self, sources: Sequence[TableSource], end: EndOfDump) -> bool:
        """Take over the windows the dump just opened; False (nothing taken) if none."""
        windows = spread_windows(sources)
        if not windows:
            return False
        self.windows, self.end = windows, end
        self.opened += 1
        self._steps, self._since = 0, time.perf_counter()
        return True

    def advance(self, finish: bool = False, early: bool = True) -> None:
        """Queue the rows read this step; queue the dump's end once every row is read.

        Args:
            finish: read every row still pending now (waits for the device).
            early: with ``finish``, count the window as cut short (``finished_early``); not
                for the final dump, which no step follows.
        """
        if self.end is None:
            return
        seq, step = self.end.seq, self.end.last_step
        if finish:
            self.finished_early += early
        else:
            self._steps += 1
        for window, tables in self.windows:
            for member, rows in window.advance(finish):
                if isinstance(rows, DeviceRows):  # the worker copies it out: no host bytes yet
                    self.queue.put(Chunk(seq, tables[member], step, rows), 0)
                else:
                    self.queue.put(Chunk(seq, tables[member], step, rows), rows.nbytes)
        if all(w.closed for w, _ in self.windows):
            end, self.end, self.windows = self.end, None, []
            self.last_window = (self._steps, time.perf_counter() - self._since)
            self.queue.put(end, 0)

    def close(self) -> None:
        """Read what the open dump still holds (the dumper closes); a failure drops it."""
        if self.end is None:
            return
        seq = self.end.seq
        try:
            self.advance(finish=True)
        except Exception:
            log.exception("reading the rest of dump %d failed; it is not committed", seq)
            self.drop()

    def drop(self) -> None:
        """Forget the open dump: it is never committed.

        A generation starts afresh, or the dumper fails; its rows already queued are aborted
        with it by the worker.
        """
        for window, _ in self.windows:
            window.close()
        self.windows, self.end = [], None
