"""Device staging of a dump: a budget of device memory for gathered rows, and its scope.

On CUDA a dump gathers each table's touched rows into a **device staging buffer**
(:class:`~deltarec.tracking.gather.DeviceRows`) and the training thread goes on at once; the
dump worker copies the buffer to host memory chunk by chunk. The buffers of the dumps in
flight are bounded by a :class:`DeviceBudget`: a share of the device memory that is free (to
the driver or in torch's cache) when the budget is first used on that device. A table whose
rows do not fit is staged as far as the room left allows and the rest gathered the way it
always was, chunk by chunk into host memory: that fallback is logged and counted.

The standard library only (torch is imported when a CUDA device's budget is first measured).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from deltarec.tracking.pinned import PinnedRing

log = logging.getLogger(__name__)


class DeviceBudget:
    """Bytes of device memory that staged dumps may hold, per device.

    The capacity on a device is ``share`` of the memory free there (``cudaMemGetInfo`` plus
    what torch's caching allocator holds unused) when the budget is first asked for on it.
    Thread-safe: the training thread takes, the dump worker gives back.

    Args:
        share: fraction of free device memory (0 disables device staging).
        capacity_bytes: a fixed capacity instead of the share (tests, benchmarks).

    Attributes:
        staged: tables staged on the device.
        full: tables that did not fit whole; their rows beyond the room were gathered into
            host memory instead.
        split: of those, tables staged in part (the rest gathered into host memory).
        peak_bytes: the most bytes ever held.
    """

    def __init__(self, share: float, capacity_bytes: int | None = None) -> None:
        if not 0.0 <= share < 1.0:
            raise ValueError(f"device staging share must be in [0, 1), got {share}")
        self.share = share
        self.fixed = capacity_bytes
        self._capacity: dict[torch.device, int] = {}
        self._held: dict[torch.device, int] = {}
        self._lock = threading.Lock()
        self.staged = 0
        self.full = 0
        self.split = 0
        self.peak_bytes = 0

    def capacity(self, device: torch.device) -> int:
        """The capacity on ``device`` (measured once, at the first call for it)."""
        with self._lock:
            return self._capacity_locked(device)

    def _capacity_locked(self, device: torch.device) -> int:
        cap = self._capacity.get(device)
        if cap is None:
            if self.fixed is not None:
                cap = int(self.fixed)
            elif self.share <= 0 or device.type != "cuda":
                cap = 0
            else:
                import torch

                free, _ = torch.cuda.mem_get_info(device)
                cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
                cap = int(self.share * (free + cached))
            self._capacity[device] = cap
        return cap

    def held(self, device: torch.device) -> int:
        """Bytes held on ``device`` now."""
        with self._lock:
            return self._held.get(device, 0)

    def try_take(self, device: torch.device, nbytes: int, what: str) -> bool:
        """Take ``nbytes`` on ``device`` if they fit; else log, count and return False."""
        with self._lock:
            cap = self._capacity_locked(device)
            held = self._held.get(device, 0)
            if cap > 0 and held + nbytes <= cap:
                self._held[device] = held + nbytes
                self.staged += 1
                self.peak_bytes = max(self.peak_bytes, held + nbytes)
                return True
            if cap > 0:
                self.full += 1
        if cap > 0:
            log.warning(
                "device staging buffer full on %s: %s needs %.1f MiB, %.1f of %.1f MiB held; "
                "gathering it into host memory instead (the training thread waits for space)",
                device,
                what,
                nbytes / 2**20,
                held / 2**20,
                cap / 2**20,
            )
        return False

    def take_rows(
        self, device: torch.device, rows: int, row_bytes: int, what: str, min_rows: int = 1
    ) -> int:
        """Take room for all ``rows`` if they fit, else for the first rows that fit.

        A table larger than the room left is staged in part (at least ``min_rows`` rows, else
        none) and the rest gathered into host memory: only the rows beyond the room wait for
        the host budget, not the whole table. Logs and counts a table that did not fit whole
        (``full``; ``split`` when part of it was staged).

        Returns:
            The rows taken (``rows``, a prefix of them, or 0).
        """
        with self._lock:
            cap = self._capacity_locked(device)
            held = self._held.get(device, 0)
            room = max(cap - held, 0) if cap > 0 else 0
            take = rows if rows * row_bytes <= room else room // max(row_bytes, 1)
            if take < rows and take < min_rows:
                take = 0
            if take:
                self._held[device] = held + take * row_bytes
                self.staged += 1
                self.peak_bytes = max(self.peak_bytes, held + take * row_bytes)
            if cap > 0 and take < rows:
                self.full += 1
                self.split += take > 0
        if cap > 0 and take < rows:
            log.warning(
                "device staging buffer full on %s: %s needs %.1f MiB, %.1f of %.1f MiB held; "
                "%d of its %d rows staged on the device, the rest gathered into host memory "
                "(the training thread waits for the copy and for host budget)",
                device,
                what,
                rows * row_bytes / 2**20,
                held / 2**20,
                cap / 2**20,
                take,
                rows,
            )
        return take

    def try_take_quietly(self, device: torch.device, nbytes: int) -> bool:
        """Take ``nbytes`` on ``device`` if they fit; nothing logged or counted if not.

        For reads that wait for room as a matter of course (a spread dump's background reads,
        :mod:`deltarec.tracking.spread`, go on at a later step).
        """
        with self._lock:
            cap = self._capacity_locked(device)
            held = self._held.get(device, 0)
            if cap <= 0 or held + nbytes > cap:
                return False
            self._held[device] = held + nbytes
            self.peak_bytes = max(self.peak_bytes, held + nbytes)
            return True

    def force_take(self, device: torch.device, nbytes: int) -> None:
        """Take ``nbytes`` on ``device`` even beyond the capacity.

        For small reads that cannot wait: a spread dump's copies on write, which the step's
        update must not overtake.
        """
        with self._lock:
            held = self._held.get(device, 0) + nbytes
            self._held[device] = held
            self.peak_bytes = max(self.peak_bytes, held)

    def give_back(self, device: torch.device, nbytes: int) -> None:
        """Return bytes taken by :meth:`try_take`."""
        with self._lock:
            self._held[device] = self._held.get(device, 0) - nbytes

    def metrics(self) -> dict[str, int]:
        """Counters for logs and metrics: staged, full (fallbacks), peak, held, capacity bytes."""
        with self._lock:
            return {
                "staged": self.staged,
                "full": self.full,
                "split": self.split,
                "peak_bytes": self.peak_bytes,
                "held_bytes": sum(self._held.values()),
                "capacity_bytes": sum(self._capacity.values()),
            }


_SCOPE = threading.local()


@contextmanager
def device_staging(budget: DeviceBudget | None, ring: PinnedRing | None = None) -> Iterator[None]:
    """Let :func:`~deltarec.tracking.gather.gather_to_host` stage whole tables on the device.

    Applies on this thread within the block, under ``budget`` (None: never). Chunks copied
    to host memory within the block lie in slots of ``ring`` (None: pinned one by one); the
    block's consumer must :meth:`~deltarec.tracking.gather.HostRows.free` each (the dumper's
    worker does, once a chunk is written).
    """
    previous = getattr(_SCOPE, "budget", None), getattr(_SCOPE, "ring", None)
    _SCOPE.budget, _SCOPE.ring = budget, ring
    try:
        yield
    finally:
        _SCOPE.budget, _SCOPE.ring = previous


def current_budget() -> DeviceBudget | None:
    """The device budget of the enclosing :func:`device_staging` block on this thread."""
    return getattr(_SCOPE, "budget", None)


def current_ring() -> PinnedRing | None:
    """The pinned ring of the enclosing :func:`device_staging` block on this thread."""
    return getattr(_SCOPE, "ring", None)
