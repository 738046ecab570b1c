"""What each dump costs the training thread: its hold, wall and CPU time, per table.

:class:`DumpHolds` keeps the latest dumps' figures for the dumper's metrics and the
benchmarks. With CUDA, a dump's **hold** is the time between two events on the training
stream, recorded as the dump begins and once its last device work is queued: the dump's own
device work and the waits of its host synchronizations, not the work the steps before it had
queued (docs/dump.md). It is known once the second event has completed, so a figure appears at
a later call. Without CUDA the hold is the thread's wall time in the dump.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from deltarec.tracking.gather import current_stream

_Pair = tuple[torch.cuda.Event, torch.cuda.Event]


@dataclass
class HoldStart:
    """A dump's start, as :meth:`DumpHolds.begin` took it."""

    wall: float
    cpu: float
    events: _Pair | None


@dataclass
class DumpHolds:
    """The training thread's cost of the latest ``kept`` dumps.

    Attributes:
        host_seconds: wall seconds the training thread spent in each dump (waits for the device
            included).
        cpu_seconds: training-thread CPU seconds of each dump (``time.thread_time``).
        timings: training-thread seconds per table of each dump.
    """

    kept: int
    host_seconds: deque[float] = field(init=False)
    cpu_seconds: deque[float] = field(init=False)
    timings: deque[dict[str, float]] = field(init=False)

    def __post_init__(self) -> None:
        self.host_seconds = deque(maxlen=self.kept)
        self.cpu_seconds = deque(maxlen=self.kept)
        self.timings = deque(maxlen=self.kept)
        self._holds: deque[float] = deque(maxlen=self.kept)
        self._pending: deque[_Pair] = deque()
        self._free: list[_Pair] = []  # event pairs whose figures were read: reused
        self._lock = threading.Lock()  # the metrics thread reads the holds too

    @property
    def seconds(self) -> deque[float]:
        """The holds of the latest dumps whose device work has run, in seconds."""
        self._resolve()
        return self._holds

    def begin(self) -> HoldStart:
        """Note a dump's start (training thread, as the dump begins)."""
        events = None
        if torch.cuda.is_initialized():
            self._resolve()
            with self._lock:
                events = self._free.pop() if self._free else None
            if events is None:
                events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            events[0].record(current_stream())
        return HoldStart(time.perf_counter(), time.thread_time(), events)

    def end(self, start: HoldStart, timing: dict[str, float]) -> None:
        """Note the dump's end (its last device work queued) and its per-table seconds."""
        wall = time.perf_counter() - start.wall
        self.host_seconds.append(wall)
        if start.events is not None:
            start.events[1].record(current_stream())
            with self._lock:
                self._pending.append(start.events)
        else:
            self._holds.append(wall)
        self.cpu_seconds.append(time.thread_time() - start.cpu)
        self.timings.append(timing)

    def _resolve(self) -> None:
        with self._lock:
            while self._pending and self._pending[0][1].query():
                begin, end = self._pending.popleft()
                self._free.append((begin, end))
                self._holds.append(begin.elapsed_time(end) / 1e3)
