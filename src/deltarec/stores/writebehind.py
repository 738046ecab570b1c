"""Flush a SQLite database's WAL to disk while a long write transaction is still running.

In WAL mode with ``synchronous = NORMAL`` SQLite syncs nothing until a checkpoint, and the
checkpoint that a large transaction's ``COMMIT`` runs first syncs the whole WAL, then copies its
pages into the database file and syncs that: two full writes to disk, one after the other,
with the committing thread waiting. A publish of 1M rows of dim 64 writes 275 MB of WAL, and
the commit took 0.43-0.49 s of which 0.3 s were the two syncs (0.18 s with
``synchronous = OFF``). :class:`WriteBehind` syncs the WAL file on a thread of its own while the
statements still run (the disk writes what SQLite has handed to the kernel so far), and the
database file while the checkpoint copies into it, so each final sync finds little left to
write: the commit took 0.25-0.30 s, the statements no longer (bench/peers, BENCHMARKS.md).

It changes no data and no ordering (a sync only hastens the kernel's write-back of pages that
are already written), so SQLite's guarantees are the same as without it; PostgreSQL's
``wal_writer_flush_after`` and ``checkpoint_flush_after`` do the same inside the server.
"""

from __future__ import annotations

import os
import threading
from types import TracebackType

FLUSH_EVERY_S = 0.05
"""Seconds between syncs while a transaction runs; the first comes this long after the start,
so a short transaction ends before any."""


class WriteBehind:
    """Syncs a database's WAL, and its file once the commit starts, until the block ends.

    Every :data:`FLUSH_EVERY_S`: ``<path>-wal``, and ``path`` too after :meth:`committing`.
    A file that does not exist yet is looked for again at the next tick. An error of a sync is
    kept off the writer: the writer's own commit syncs (and reports) the same files.

    Args:
        path: the database file (``<path>-wal`` is its WAL).
    """

    def __init__(self, path: str) -> None:
        self._paths = (f"{path}-wal", path)
        self._fds: list[int] = []
        self._files = 1  # the WAL only, until the commit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sqlite-write-behind", daemon=True)

    def __enter__(self) -> WriteBehind:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def committing(self) -> None:
        """From now on sync the database file too (the checkpoint writes into it)."""
        self._files = 2

    def _run(self) -> None:
        while not self._stop.wait(FLUSH_EVERY_S):
            try:
                while len(self._fds) < self._files:
                    self._fds.append(os.open(self._paths[len(self._fds)], os.O_RDONLY))
                for fd in self._fds:
                    os.fdatasync(fd)
            except OSError:
                continue  # not there yet, or a sync failed: the commit's own sync decides
