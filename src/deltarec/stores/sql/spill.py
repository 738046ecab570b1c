"""A write's rows parked in a file until all have come, then read back in key order.

SQLite's bulk upsert is several times faster in key order (fewer B-tree pages touched at
random); a write of several batches out of key order parks them here (:class:`Spill`) and
applies them from the file in key order. Used by :mod:`deltarec.stores.sql.sqlite`.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Generator
from types import TracebackType
from typing import Any

import numpy as np

from deltarec.errors import StoreError
from deltarec.readahead import ReadAhead

SPILL_READ_BYTES = 8 << 20
"""Rows read back from a write's spill files at a time, in key order."""
_META = np.dtype([("version", "<i8"), ("op", "i1")])
"""A spilled row's version and op, kept in a file beside the rows'."""


class Spill:
    """The rows of one write that wait in a file until all have come, then come back in key order.

    Each batch is appended sorted by key: its rows to one file, their versions and ops to
    another (each a plain array, so the copies are contiguous); only the keys stay in memory
    (8 bytes a row). A bulk upsert into SQLite's B-tree is several times faster in key
    order. Reading back, a chunk of consecutive keys holds one contiguous range of each batch,
    so it takes one read per batch. The file is unlinked from the start (it goes to
    ``SQLITE_TMPDIR``, else Python's temporary directory) and needs about the write's size.
    """

    def __init__(self) -> None:
        tmp = os.environ.get("SQLITE_TMPDIR") or None
        self._file = tempfile.TemporaryFile(dir=tmp)  # noqa: SIM115 (closed by __exit__)
        self._meta = tempfile.TemporaryFile(dir=tmp)  # noqa: SIM115 (closed by __exit__)
        self._keys: list[np.ndarray] = []
        self._rows: np.ndarray[Any, Any] | None = None  # reused, sized on first use
        self._metas: np.ndarray[Any, Any] = np.empty(0, _META)

    def __enter__(self) -> Spill:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._file.close()
        self._meta.close()

    def add(
        self,
        keys: np.ndarray,
        embedding: np.ndarray,
        versions: np.ndarray,
        ops: np.ndarray,
        keep: np.ndarray | None,
    ) -> None:
        """Append the rows ``keep`` marks (None: all), sorted by key (a stable sort)."""
        rows = np.arange(len(keys)) if keep is None else np.flatnonzero(keep)
        rows = rows[key_order(keys[rows])]
        if self._rows is None:  # the rows of one view: one width, one dtype
            row_bytes = embedding.dtype.itemsize * int(np.prod(embedding.shape[1:]))
            n = max(1, SPILL_READ_BYTES // (row_bytes + _META.itemsize))
            self._rows = np.empty((n, *embedding.shape[1:]), embedding.dtype)
            self._metas = np.empty(n, _META)
        for start in range(0, len(rows), len(self._rows)):
            part = rows[start : start + len(self._rows)]
            out, meta = self._rows[: len(part)], self._metas[: len(part)]
            np.take(embedding, part, axis=0, out=out, mode="clip")  # part is in range
            meta["version"], meta["op"] = versions[part], ops[part]
            self._file.write(out.data)
            self._meta.write(meta.data)
        self._keys.append(keys[rows])

    def rows_ahead(self) -> ReadAhead[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """:meth:`rows` read on a thread of its own, one chunk ahead of the caller.

        The caller applies a chunk (SQLite statements, which release the GIL) while the next one
        is read from the spill files and gathered into key order: on two cores the two overlap
        instead of taking turns. An error of the reading is raised where its chunk would have
        come. Use it as a context manager inside the spill's, so that its thread has stopped
        before the spill's files are closed.
        """
        return ReadAhead(self.rows(), 1, "spill-read")

    def rows(self) -> Generator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """``(keys, rows, versions, ops)`` of every row added, in key order, a chunk at a time.

        Rows of one key keep the order in which they were added.
        """
        if self._rows is None:
            return
        self._file.flush()
        self._meta.flush()
        keys = np.concatenate(self._keys)
        self._keys = []
        # Each batch's keys are sorted: a stable sort (timsort for int64) merges the runs, about
        # 4x faster than sorting them as if at random, and keeps a key's rows in added order.
        order = np.argsort(keys, kind="stable")
        if len(order) < 2**31:
            order = order.astype(np.int32)
        size, meta_size = self._rows[0].nbytes, _META.itemsize
        for start in range(0, len(order), len(self._rows)):
            take = order[start : start + len(self._rows)]
            at = np.sort(take)  # positions in the files: one contiguous range per batch
            rows, metas = self._rows[: len(at)], self._metas[: len(at)]
            raw, raw_meta = rows.data.cast("B"), metas.data.cast("B")
            bounds = np.concatenate([[0], np.flatnonzero(np.diff(at) != 1) + 1, [len(at)]])
            for a, b in itertools.pairwise(bounds.tolist()):
                first = int(at[a])
                _read_exactly(self._file.fileno(), raw[a * size : b * size], first * size)
                _read_exactly(
                    self._meta.fileno(),
                    raw_meta[a * meta_size : b * meta_size],
                    first * meta_size,
                )
            pos = np.searchsorted(at, take)
            # Gathered into new contiguous arrays, so the store can bind a statement's rows
            # as a view of them (no further copy).
            meta = metas[pos]
            yield keys[take], rows[pos], meta["version"], meta["op"]


def key_order(keys: np.ndarray) -> np.ndarray:
    """Indices that put ``keys`` in order, rows of one key in the order they come.

    numpy's default sort (about 4x a stable one on int64 here); the stable sort only when a
    key repeats, where the order of its rows matters.
    """
    order = np.argsort(keys)
    ordered = keys[order]
    if len(ordered) > 1 and not (ordered[1:] != ordered[:-1]).all():
        return np.argsort(keys, kind="stable")
    return order


def _read_exactly(fd: int, into: memoryview, offset: int) -> None:
    """Fill ``into`` from file ``fd`` at ``offset``."""
    done = 0
    while done < len(into):
        n = os.preadv(fd, [into[done:]], offset + done)
        if n <= 0:
            raise StoreError(f"spill file ended early: {done} of {len(into)} bytes at {offset}")
        done += n
