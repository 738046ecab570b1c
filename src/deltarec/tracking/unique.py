"""Deduplicating several tables' touched ids on one device together, without waiting.

:class:`UniqueBatch` numbers the rows of a device's tables one after the other in one bitmap;
a dump marks, compacts and splits it with a fixed number of CUDA calls whatever the number of
tables (:class:`~deltarec.tracking.plain.RowShardSource` groups use it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deltarec.tracking.gather import current_stream, warm_up_gather

BATCH_ROWS_MAX = (1 << 31) - 1
"""Rows of one shared bitmap at most (torch's CUDA compaction counts positions in int32)."""


class UniqueBatch:
    """The touched ids of several tables on one device, deduplicated together without waiting.

    The tables' rows are numbered one after the other (table ``i``'s row ``r`` is
    ``bases[i] + r``) in one bitmap, allocated once and cleared after every use. A dump marks
    each table's recorded ids in its block of the bitmap (one ``index_fill_`` per table),
    compacts the whole bitmap once (``torch.nonzero_static`` into a buffer as long as the ids
    recorded: a length the host knows, so nothing waits; padded with the number of rows, so
    the buffer stays sorted) and finds where each table's ids end in it with one
    ``searchsorted``. The ends come to host memory in one asynchronous copy behind one event:
    the first :meth:`BatchedIds.ids` waits once per dump, for every table. Before this each
    table took a bitmap, a compaction, a count, a copy and an event of its own: about ten
    CUDA calls per table on the training thread at every dump. (Sorting the ids instead of
    marking a bitmap reads only the ids, not every row, but measured no faster for a 2 ms
    step's few ids and slower for more: the training thread's calls, not the device, bound
    this.)

    Args:
        rows: each table's (local part's) row count, in order.
        device: where the tables and their recorded ids are.
    """

    def __init__(self, rows: Sequence[int], device: torch.device) -> None:
        self.rows = [int(n) for n in rows]
        self.bases = [sum(self.rows[:i]) for i in range(len(self.rows))]
        self.total = sum(self.rows)
        self.device = device
        self.bitmap = torch.zeros(self.total, dtype=torch.bool, device=device)
        self.blocks = [self.bitmap[b : b + n] for b, n in zip(self.bases, self.rows, strict=True)]
        ends = [b + n for b, n in zip(self.bases, self.rows, strict=True)]
        self.ends = torch.tensor(ends, dtype=torch.int64, device=device)
        self._spare: torch.Tensor | None = None
        self._lent: torch.Tensor | None = None
        self.marked = [0] * len(self.rows)
        """Per table, ids marked by :meth:`mark` since the last :meth:`queue` (a bound)."""
        cuda = device.type == "cuda"
        self.host_ends = torch.empty(len(ends), dtype=torch.int64, pin_memory=cuda)
        self.ready = torch.cuda.Event() if cuda else None

    def mark(self, table: int, ids: torch.Tensor) -> None:
        """Mark recorded ids of table ``table`` now; the next :meth:`queue` includes them.

        One ``index_fill_`` on the current stream, nothing waits: the dumper marks what was
        recorded between dumps as it comes (:meth:`~deltarec.tracking.plain.RowShardSource.
        absorb_recorded`), so a dump of many steps' lookups does not concatenate and mark them
        all on the training thread at the dump step.

        Args:
            table: the table's position.
            ids: any-shaped integer ids in ``[0, rows)`` (duplicates allowed).
        """
        flat = ids.reshape(-1) if ids.dim() != 1 else ids
        if flat.numel() == 0:
            return
        if flat.dtype != torch.int64 or flat.device != self.device:
            flat = flat.to(self.device, torch.int64)
        self.blocks[table].index_fill_(0, flat, True)  # a scalar fill: no value tensor copied
        self.marked[table] = min(self.marked[table] + int(flat.numel()), self.rows[table])

    def clear(self, table: int) -> None:
        """Forget the ids marked for table ``table`` (a generation starts afresh)."""
        if self.marked[table]:
            self.blocks[table].zero_()
            self.marked[table] = 0

    def recycle(self) -> None:
        """Take back the bitmap the last :meth:`take_marks` gave out, every flag clear again.

        Clear in stream order: the next :meth:`take_marks` then neither allocates nor clears.
        """
        self._spare, self._lent = self._lent, None

    def take_marks(self, recorded: Sequence[torch.Tensor | None]) -> list[torch.Tensor] | None:
        """Mark ``recorded`` and take the bitmap as it is: per table, a flag per touched row.

        The batch goes on with a cleared bitmap of its own (the next dump's marks); the one
        returned belongs to the caller (a spread dump's pending rows,
        :mod:`deltarec.tracking.spread`). None, and nothing taken, when no id was marked.
        """
        for i, ids in enumerate(recorded):
            if ids is not None:
                self.mark(i, ids)
        if not any(self.marked):
            return None
        taken = self._lent = self.bitmap
        spare, self._spare = self._spare, None
        self.bitmap = spare if spare is not None else torch.zeros_like(taken)
        self.blocks = [self.bitmap[b : b + n] for b, n in zip(self.bases, self.rows, strict=True)]
        self.marked = [0] * len(self.rows)
        return [taken[b : b + n] for b, n in zip(self.bases, self.rows, strict=True)]

    def queue(self, recorded: Sequence[torch.Tensor | None]) -> BatchedIds:
        """Queue the deduplication of each table's recorded ids (None: the table had none).

        The ids marked by :meth:`mark` since the last call are included.

        Args:
            recorded: per table, any-shaped integer ids in ``[0, rows)`` (duplicates allowed).

        Returns:
            The dump's ids, to be read after this call (nothing is queued without any id).
        """
        for i, ids in enumerate(recorded):
            if ids is not None:
                self.mark(i, ids)
        bound = sum(self.marked)
        if bound == 0:
            return BatchedIds(self, None)
        self.marked = [0] * len(self.rows)
        unique = torch.nonzero_static(self.bitmap, size=bound, fill_value=self.total).view(-1)
        self.bitmap.zero_()  # in stream order: after the compaction, before the next marks
        self.host_ends.copy_(torch.searchsorted(unique, self.ends), non_blocking=True)
        if self.ready is not None:
            self.ready.record(current_stream(self.device))
        return BatchedIds(self, unique)

    def warm_up(self, weights: Sequence[torch.Tensor]) -> None:
        """Deduplicate one id per table and gather its row once (before training).

        A dump's first calls otherwise load their kernels and allocate on the training thread.
        """
        one = torch.zeros(1, dtype=torch.int64, device=self.device)
        dump = self.queue([one] * len(self.rows))
        for i, w in enumerate(weights):
            warm_up_gather(w, dump.ids(i))


class BatchedIds:
    """One dump's deduplicated ids of a :class:`UniqueBatch`'s tables, ends on their way."""

    def __init__(self, batch: UniqueBatch, unique: torch.Tensor | None) -> None:
        self.batch = batch
        self.unique = unique
        self._ends: list[int] | None = None

    def ids(self, table: int) -> torch.Tensor:
        """Table ``table``'s sorted unique local ids (the first call waits, once for all)."""
        b = self.batch
        if self.unique is None:
            return torch.empty(0, dtype=torch.int64, device=b.device)
        if self._ends is None:
            if b.ready is not None:
                b.ready.synchronize()
            self._ends = [0, *b.host_ends.tolist()]
        got = self.unique[self._ends[table] : self._ends[table + 1]]
        return got - b.bases[table] if b.bases[table] else got


__all__ = ["BATCH_ROWS_MAX", "BatchedIds", "UniqueBatch"]
