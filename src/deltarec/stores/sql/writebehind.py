"""Flush a SQLite database's WAL to disk while a long write transaction is still running.

In WAL mode with ``synchronous = NORMAL`` SQLite syncs nothing until a checkpoint, and the
checkpoint that a large transaction's ``COMMIT`` runs first syncs the whole WAL, then copies its
pages into the database file and syncs that: two full writes to disk, one after the other,
with the committing thread waiting. A publish of 1M rows of dim 64 writes 275 MB of WAL, and
the commit took 0.43-0.49 s of which 0.3 s were the two syncs (0.18 s with
``synchronous = OFF``). :class:`WriteBehind` syncs the WAL file on a thread of its own while the
statements still run (the disk writes what SQLite has handed to the kernel so far), and the
database file while the checkpoint copies into it, so each final sync finds little left to
write: the commit took 0.23-0.25 s, the statements no longer (BENCHMARKS.md).

It changes no data and no ordering (a sync only hastens the kernel's write-back of pages that
are already written), so SQLite's guarantees are the same as without it; PostgreSQL's
``wal_writer_flush_after`` and ``checkpoint_flush_after`` do the same inside the server.

One thread per store, started at its first bulk write and idle between writes: a thread started
and ended per write made glibc hand the short-lived threads' allocator arenas around, and a
10M-row publish peaked 15-25 MB higher (BENCHMARKS.md).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

FLUSH_EVERY_S = 0.05
"""Seconds between syncs while a write runs; the first comes this long after its start, so a
short write ends before any."""


class WriteBehind:
    """Syncs a database's WAL while a write runs, and its file once the commit starts.

    Every :data:`FLUSH_EVERY_S` inside :meth:`writing`: ``<path>-wal``, and ``path`` too after
    :meth:`committing`. A file that does not exist yet is looked for again at the next tick. An
    error of a sync is kept off the writer: the writer's own commit syncs (and reports) the
    same files. :meth:`close` stops the thread.

    Args:
        path: the database file (``<path>-wal`` is its WAL).
    """

    def __init__(self, path: str) -> None:
        self._paths = (f"{path}-wal", path)
        self._fds: list[int] = []
        self._files = 0  # files to sync now: 0 between writes, 1 the WAL, 2 both
        self._closed = False
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    @contextmanager
    def writing(self) -> Iterator[WriteBehind]:
        """Sync the WAL until the block ends (one write at a time)."""
        with self._changed:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="sqlite-write-behind", daemon=True
                )
                self._thread.start()
            self._files = 1
            self._changed.notify()
        try:
            yield self
        finally:
            with self._changed:
                self._files = 0  # the thread finishes a sync it is in, then waits

    def committing(self) -> None:
        """From now on sync the database file too (the checkpoint writes into it)."""
        with self._changed:
            self._files = 2

    def close(self) -> None:
        """Stop the thread and close the files (idempotent)."""
        with self._changed:
            self._closed = True
            self._changed.notify()
        if self._thread is not None:
            self._thread.join()
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def _run(self) -> None:
        with self._changed:
            while not self._closed:
                if not self._files:
                    self._changed.wait()
                    continue
                self._changed.wait(FLUSH_EVERY_S)
                files = self._files
                if not files or self._closed:
                    continue
                self._changed.release()  # the writer may end or commit meanwhile
                try:
                    self._sync(files)
                finally:
                    self._changed.acquire()

    def _sync(self, files: int) -> None:
        try:
            while len(self._fds) < files:
                self._fds.append(os.open(self._paths[len(self._fds)], os.O_RDONLY))
            for fd in self._fds[:files]:
                os.fdatasync(fd)
        except OSError:
            pass  # not there yet, or a sync failed: the commit's own sync decides
