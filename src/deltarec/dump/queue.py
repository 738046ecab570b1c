"""A FIFO queue bounded in bytes: the producer waits for space instead of memory growing.

The training thread puts gathered host chunks; the background worker takes them and releases
their bytes only when it has finished with them (written and dropped). So the bytes held by
the dump path (queued plus in the worker's hands) never exceed the capacity, except for one
item larger than the capacity, which is admitted alone when the queue is empty (otherwise it
could never pass). Nothing is ever dropped.

The worker may also :meth:`reserve` bytes for what it makes from an item (the host copy of a
device staging buffer, the encoded form of a chunk): it waits, in the background, until the
bytes it already holds elsewhere are released, never for the items still queued (only it can
take those), so the outstanding bytes stay within the capacity plus one reservation.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any


class QueueClosedError(RuntimeError):
    """The queue was closed (the worker stopped) while a producer waited or put."""


class ByteBoundedQueue:
    """FIFO of ``(item, nbytes)`` with at most ``capacity`` bytes outstanding.

    Args:
        capacity: the byte budget (> 0).
        abort_check: called while a producer waits; raising from it aborts the wait (the
            dumper passes a check that re-raises a worker failure).

    Attributes:
        peak_bytes: the most bytes ever outstanding.
        blocked_seconds: total time producers spent waiting for space.
        blocked_puts: number of puts that had to wait.
        blocked_reserves: number of :meth:`reserve` calls that had to wait.
    """

    def __init__(self, capacity: int, abort_check: Callable[[], None] | None = None) -> None:
        if capacity <= 0:
            raise ValueError(f"queue capacity must be > 0 bytes, got {capacity}")
        self.capacity = int(capacity)
        self._abort_check = abort_check
        self._items: collections.deque[tuple[Any, int]] = collections.deque()
        self._outstanding = 0
        self._queued = 0
        self._cond = threading.Condition()
        self._closed = False
        self.peak_bytes = 0
        self.blocked_seconds = 0.0
        self.blocked_puts = 0
        self.blocked_reserves = 0

    @property
    def outstanding_bytes(self) -> int:
        """Bytes put and not yet released."""
        with self._cond:
            return self._outstanding

    def put(self, item: Any, nbytes: int) -> None:
        """Append ``item``; wait while it would push the outstanding bytes over capacity.

        Raises:
            QueueClosedError: if the queue is (or gets) closed.
            Exception: whatever ``abort_check`` raises while waiting.
        """
        nbytes = max(0, int(nbytes))
        with self._cond:
            started = None
            while (
                not self._closed
                and nbytes > 0  # markers (end of dump, stop) never wait
                and self._outstanding > 0
                and self._outstanding + nbytes > self.capacity
            ):
                if started is None:
                    started = time.perf_counter()
                    self.blocked_puts += 1
                if self._abort_check is not None:
                    self._abort_check()
                self._cond.wait(timeout=0.5)
            if started is not None:
                self.blocked_seconds += time.perf_counter() - started
            if self._closed:
                raise QueueClosedError("the dump queue is closed")
            self._items.append((item, nbytes))
            self._outstanding += nbytes
            self._queued += nbytes
            self.peak_bytes = max(self.peak_bytes, self._outstanding)
            self._cond.notify_all()

    def get(self) -> tuple[Any, int]:
        """Take the oldest item (waits for one). Call :meth:`release` with its bytes when done.

        Raises:
            QueueClosedError: if the queue is closed and empty.
        """
        with self._cond:
            while not self._items and not self._closed:
                self._cond.wait()
            if not self._items:
                raise QueueClosedError("the dump queue is closed")
            item, nbytes = self._items.popleft()
            self._queued -= nbytes
            return item, nbytes

    def reserve(self, nbytes: int, held: int = 0) -> None:
        """Count ``nbytes`` more as outstanding (the consumer's side; :meth:`release` them).

        Waits while they would push the outstanding bytes over capacity and the consumer
        holds bytes beyond ``held`` (its current item's) that other threads will release;
        never waits for queued items.

        Raises:
            QueueClosedError: if the queue is closed.
        """
        nbytes = max(0, int(nbytes))
        with self._cond:
            waited = False
            while (
                not self._closed
                and self._outstanding - self._queued - held > 0
                and self._outstanding + nbytes > self.capacity
            ):
                if not waited:
                    waited = True
                    self.blocked_reserves += 1
                self._cond.wait(timeout=0.5)
            if self._closed:
                raise QueueClosedError("the dump queue is closed")
            self._outstanding += nbytes
            self.peak_bytes = max(self.peak_bytes, self._outstanding)

    def release(self, nbytes: int) -> None:
        """Give back the bytes of an item the consumer has finished with."""
        with self._cond:
            self._outstanding -= max(0, int(nbytes))
            self._cond.notify_all()

    def wait_empty(self, timeout: float | None = None) -> bool:
        """Wait until every item was taken and released. Returns False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._items or self._outstanding > 0:
                if self._abort_check is not None:
                    self._abort_check()
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(timeout=0.5 if remaining is None else min(0.5, remaining))
            return True

    def close(self) -> None:
        """Wake every waiter; later puts raise, gets drain what is left then raise."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
