"""When to dump: every N steps, every M minutes, or both, agreed by every rank.

Every rank must decide to dump at the same step, and the per-step path must not run a
collective operation. A step cadence is deterministic. A time cadence is not (each rank has its
own clock), so it is turned into steps at **clock agreements**: at a few agreed steps, rank 0's
clock is broadcast (one tiny collective, on the dumper's own gloo group) and every rank derives
the same next step from it:

* if the deadline (previous dump time + M minutes) has passed, the dump happens at this step;
* otherwise, with ``r`` seconds left and a measured ``s`` seconds per step, the next agreement
  is ``ceil(r / s / 2)`` steps ahead (at least 1, at most ``max_gap``) - so the estimate is
  refined as the deadline approaches and a dump is late by at most about one step, with
  O(log) agreements per interval and none on ordinary steps.

:class:`Cadence` holds only integers between agreements; ``due(step)`` is two comparisons.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

ClockSync = Callable[[], float]
"""Returns rank 0's clock (seconds) on every rank: a collective, called at agreed steps only."""


@dataclass
class Cadence:
    """The dump schedule of one generation.

    Args:
        every_steps: dump every this many steps (None: no step cadence).
        every_minutes: dump every this many minutes (None: no time cadence).
        clock_sync: agreed clock, called at agreement steps (collective on several ranks).
        max_gap: at most this many steps between two clock agreements.
    """

    every_steps: int | None
    every_minutes: float | None
    clock_sync: ClockSync
    max_gap: int = 1000
    _last_dump_step: int = 0
    _last_dump_time: float = 0.0
    _next_step_dump: int | None = None
    _next_sync: int | None = None
    _sync_step: int = 0
    _sync_time: float = 0.0
    syncs: int = 0

    def start(self, step: int) -> None:
        """A dump (or the generation's start) happened at ``step``: schedule the next one.

        Runs one clock agreement when a time cadence is configured.
        """
        self._last_dump_step = step
        self._next_step_dump = step + self.every_steps if self.every_steps else None
        if self.every_minutes is not None:
            now = self._sync()
            self._last_dump_time = now
            self._sync_step, self._sync_time = step, now
            self._next_sync = step + 1
        else:
            self._next_sync = None

    def due(self, step: int) -> bool:
        """Whether a dump is due after training step ``step`` (same answer on every rank).

        Cheap on ordinary steps; at an agreement step it runs one small collective.
        """
        if self._next_step_dump is not None and step >= self._next_step_dump:
            return True
        if self._next_sync is None or step < self._next_sync:
            return False
        return self._time_due(step)

    def _sync(self) -> float:
        self.syncs += 1
        return float(self.clock_sync())

    def _time_due(self, step: int) -> bool:
        assert self.every_minutes is not None
        now = self._sync()
        left = self._last_dump_time + self.every_minutes * 60.0 - now
        if left <= 0:
            return True
        steps_done = step - self._sync_step
        per_step = (now - self._sync_time) / steps_done if steps_done > 0 else 0.0
        self._sync_step, self._sync_time = step, now
        gap = 1 if per_step <= 0 else math.ceil(left / per_step / 2.0)
        self._next_sync = step + max(1, min(self.max_gap, gap))
        return False

    def state(self) -> dict[str, int]:
        """What a checkpoint needs to resume the step cadence."""
        return {"last_dump_step": self._last_dump_step}
