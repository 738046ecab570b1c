"""A write's rows parked in a file until all have come, then read back in key order.

SQLite's bulk upsert is several times faster in key order (fewer B-tree pages touched at
random); a write of several batches out of key order parks them here (:class:`Spill`) and
applies them from the file in key order. Used by :mod:`deltarec.stores.sqlite`.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import numpy as np

from deltarec.errors import StoreError

SPILL_READ_BYTES = 8 << 20
"""Rows read back from a write's spill file at a time, in key order."""


class Spill:
    """The rows of one write that wait in a file until all have come, then come back in key order.

    Each batch is appended sorted by key, as records (version, op, row); only the keys stay in
    memory (8 bytes a row). A bulk upsert into SQLite's B-tree is several times faster in key
    order. Reading back, a chunk of consecutive keys holds one contiguous range of each batch,
    so it takes one read per batch. The file is unlinked from the start (it goes to
    ``SQLITE_TMPDIR``, else Python's temporary directory) and needs about the write's size.
    """

    def __init__(self) -> None:
        tmp = os.environ.get("SQLITE_TMPDIR") or None
        self._file = tempfile.TemporaryFile(dir=tmp)  # noqa: SIM115 (closed by __exit__)
        self._keys: list[np.ndarray] = []
        self._record: np.dtype | None = None
        self._buffer: np.ndarray[Any, Any] = np.empty(0)  # reused records, sized on first use

    def __enter__(self) -> Spill:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._file.close()

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
        if self._record is None:  # the rows of one view: one width, one dtype
            self._record = np.dtype(
                [("version", "<i8"), ("op", "i1"), ("row", embedding.dtype, embedding.shape[1:])]
            )
            self._buffer = np.empty(max(1, SPILL_READ_BYTES // self._record.itemsize), self._record)
        for start in range(0, len(rows), len(self._buffer)):
            part = rows[start : start + len(self._buffer)]
            out = self._buffer[: len(part)]
            out["version"], out["op"] = versions[part], ops[part]
            np.take(embedding, part, axis=0, out=out["row"], mode="clip")  # part is in range
            self._file.write(out.view(np.uint8).data)
        self._keys.append(keys[rows])

    def rows(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """``(keys, rows, versions, ops)`` of every row added, in key order, a chunk at a time.

        Rows of one key keep the order in which they were added.
        """
        if self._record is None:
            return
        self._file.flush()
        keys = np.concatenate(self._keys)
        self._keys = []
        order = key_order(keys)
        if len(order) < 2**31:
            order = order.astype(np.int32)
        size = self._record.itemsize
        for start in range(0, len(order), len(self._buffer)):
            take = order[start : start + len(self._buffer)]
            at = np.sort(take)  # positions in the file: one contiguous range per batch
            buf = self._buffer[: len(at)]
            raw = buf.view(np.uint8).data
            bounds = np.concatenate([[0], np.flatnonzero(np.diff(at) != 1) + 1, [len(at)]])
            for a, b in itertools.pairwise(bounds.tolist()):
                _read_exactly(self._file.fileno(), raw[a * size : b * size], int(at[a]) * size)
            pos = np.searchsorted(at, take)
            # Each column gathered on its own: the rows come contiguous, so the store can bind
            # a statement's rows as a view of them (no further copy).
            yield keys[take], buf["row"][pos], buf["version"][pos], buf["op"][pos]


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
