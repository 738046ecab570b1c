"""Pacing: a background worker keeps its busy share of wall time under a fraction (SPEC §3a).

The trainer's background compaction (:mod:`deltarec.dump.compactor`) runs at idle CPU and I/O
priority, which keeps it off a core that training wants, but not off the memory bandwidth and
caches that the host's cores share: on a 2-core host what a compaction still costs the
training loop is the memory traffic of decoding, gathering and encoding every row
(docs/history.md, "The trainer compacts in the background"). A background compaction has no
deadline but the next one, so it can spread that traffic out: between bounded chunks of its
work (a part or a shard read, a row group gathered and encoded, a slice hashed) it calls
:func:`checkpoint`, and the :class:`Pacer` in effect sleeps so that the time spent working is
at most ``busy_share`` of the wall time.

The pacer is found through a context variable, not passed down: the readers a compaction
calls (:func:`~deltarec.artifacts.lineage.expected_state`) are shared with verify and publish,
which never pace; without a pacer :func:`checkpoint` is a lookup and a return. A pause holds
no lock nor lease (a compaction takes none), only the open files of the shards it reads;
it never changes what is written.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator
from typing import Any

from deltarec.errors import BadInputError

MIN_PAUSE_S = 0.005
"""Pauses shorter than this are owed, not slept: added to the next one (a sleep costs a
wakeup, and the share is kept over the whole run, not per chunk)."""

_CURRENT: contextvars.ContextVar[Pacer | None] = contextvars.ContextVar(
    "deltarec_pacer", default=None
)


def check_busy_share(value: float, what: str = "busy_share") -> float:
    """``value`` if ``0 < value <= 1``.

    Raises:
        BadInputError: anything else, naming ``what``.
    """
    if not 0.0 < value <= 1.0:
        raise BadInputError(f"{what} must be in (0, 1], got {value!r}")
    return float(value)


class Pacer:
    """Sleeps at :meth:`checkpoint` so that busy time stays within ``busy_share`` of the total.

    Busy time is the CPU time the process used since the last checkpoint, not the wall time:
    a worker at idle priority that waits for a core makes no memory traffic meanwhile, and
    pausing for that wait as well would only slow it further on a loaded host. Over any run
    of checkpoints ``busy_s <= busy_share * (busy_s + paced_s)`` up to one
    :data:`MIN_PAUSE_S` owed.

    Args:
        busy_share: the most of the time spent working, in ``(0, 1]``; 1: never sleeps.
        cpu_clock: the process's CPU seconds (tests pass their own).
        clock: wall seconds, monotonic: measures the pauses (tests pass their own).
        sleep: sleeps the given seconds (tests pass their own).
    """

    def __init__(
        self,
        busy_share: float,
        *,
        cpu_clock: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.busy_share = check_busy_share(busy_share)
        self._cpu_clock = cpu_clock
        self._clock = clock
        self._sleep = sleep
        self.busy_s = 0.0
        """CPU seconds worked between checkpoints so far."""
        self.paced_s = 0.0
        """Wall seconds slept by the pacer so far (measured, not asked for)."""
        self.pauses = 0
        """How many times it slept."""
        self.checkpoints = 0
        """How many chunk boundaries were passed."""
        self._since = cpu_clock()

    def checkpoint(self) -> None:
        """A chunk of work ended: sleep what keeps the busy share, if that is long enough."""
        now = self._cpu_clock()
        self.busy_s += now - self._since
        self._since = now
        self.checkpoints += 1
        owed = self.busy_s * (1.0 - self.busy_share) / self.busy_share - self.paced_s
        if owed >= MIN_PAUSE_S:
            start = self._clock()
            self._sleep(owed)
            self.paced_s += self._clock() - start
            self.pauses += 1
            self._since = self._cpu_clock()  # a sleep's own CPU (its wakeup) is not work

    def report(self) -> dict[str, Any]:
        """What it did: ``busy_share``, ``busy_s``, ``paced_s``, ``pauses``, ``checkpoints``."""
        return {
            "busy_share": self.busy_share,
            "busy_s": round(self.busy_s, 4),
            "paced_s": round(self.paced_s, 4),
            "pauses": self.pauses,
            "checkpoints": self.checkpoints,
        }


@contextlib.contextmanager
def paced(busy_share: float) -> Iterator[Pacer]:
    """Pace every :func:`checkpoint` of this context (thread, task) at ``busy_share``."""
    pacer = Pacer(busy_share)
    token = _CURRENT.set(pacer)
    try:
        yield pacer
    finally:
        _CURRENT.reset(token)


def checkpoint() -> None:
    """A bounded chunk of work ended: the pacer in effect may sleep here (none: returns)."""
    pacer = _CURRENT.get()
    if pacer is not None:
        pacer.checkpoint()


__all__ = ["MIN_PAUSE_S", "Pacer", "check_busy_share", "checkpoint", "paced"]
