"""Deduplicating several tables' touched ids on one device together, without waiting.

:class:`UniqueBatch` numbers the rows of a device's tables one after the other in one bitmap;
a dump marks, compacts and splits it with a fixed number of CUDA calls whatever the number of
tables (:class:`~deltarec.tracking.plain.RowShardSource` groups use it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deltarec.tracking.device_budget import DeviceBudget
from deltarec.tracking.gather import CountedRows, current_stream, upserts, warm_up_gather

BATCH_ROWS_MAX = (1 << 31) - 1
"""Rows of one shared bitmap at most (torch's CUDA compaction counts positions in int32)."""

COUNTED_PAD_BYTES = 0
"""The most bytes of padding a counted dump may gather (:meth:`UniqueBatch.gather_counted`);
0 (the default) turns counted dumps off.

Its buffers are as long as the rows flagged when the batch last counted its marks plus every
id marked since (a few steps' lookups): the padding is gathered too, at ~3 TB/s about 0.1 ms
of device time for 256 MiB (``256 << 20`` is the value to try), against the host
synchronization and the staging calls of the exact path it replaces. Off until a GPU training
loop has measured it (docs/dump.md, *Counted dumps*)."""


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
        self._counts = torch.zeros(len(self.rows), dtype=torch.int64, device=device)
        self._host_counts = torch.zeros(len(self.rows), dtype=torch.int64, pin_memory=cuda)
        self._counted = torch.cuda.Event() if cuda else None
        self.known: list[int] | None = [0] * len(self.rows)
        """Per table, the rows flagged when the batch last knew it on the host (None: a count
        is on its way, :meth:`count_marks`); ``since`` ids were marked after it."""
        self.since = [0] * len(self.rows)
        self._count_pending = False

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
        n = int(flat.numel())
        self.marked[table] = min(self.marked[table] + n, self.rows[table])
        self.since[table] += n

    def clear(self, table: int) -> None:
        """Forget the ids marked for table ``table`` (a generation starts afresh)."""
        if self.marked[table]:
            self.blocks[table].zero_()
            self.marked[table] = 0
            if self.known is not None:
                self.known[table], self.since[table] = 0, 0
            else:  # the count on its way still holds the table's marks: not to be trusted
                self._count_pending = False

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
        self._cleared()
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
        self._cleared()
        unique = torch.nonzero_static(self.bitmap, size=bound, fill_value=self.total).view(-1)
        self.bitmap.zero_()  # in stream order: after the compaction, before the next marks
        self.host_ends.copy_(torch.searchsorted(unique, self.ends), non_blocking=True)
        if self.ready is not None:
            self.ready.record(current_stream(self.device))
        return BatchedIds(self, unique)

    @property
    def counting(self) -> bool:
        """Whether counted dumps are on (:data:`COUNTED_PAD_BYTES`): marks are then counted."""
        return COUNTED_PAD_BYTES > 0

    def count_marks(self) -> None:
        """Count each table's flagged rows on the device, the counts on their way to the host.

        Called after marking between dumps (:meth:`~deltarec.tracking.groups.TableGroup.
        absorb`): a sum per table and one asynchronous copy behind an event, nothing waits.
        A later :meth:`gather_counted` reads them once the event has passed.
        """
        for i, block in enumerate(self.blocks):
            torch.sum(block, dim=0, out=self._counts[i])
        self._host_counts.copy_(self._counts, non_blocking=True)
        if self._counted is not None:
            self._counted.record(current_stream(self.device))
        self.known, self.since, self._count_pending = None, [0] * len(self.rows), True

    def bounds(self) -> list[int] | None:
        """Per table, at most how many rows are flagged now (None: not known without waiting).

        The rows flagged at the last count (or clear) plus every id marked since.
        """
        if self.known is None:
            if not self._count_pending:
                return None
            if self._counted is not None and not self._counted.query():
                return None
            self.known, self._count_pending = self._host_counts.tolist(), False
        assert self.known is not None
        return [min(k + s, n) for k, s, n in zip(self.known, self.since, self.rows, strict=True)]

    def gather_counted(
        self,
        recorded: Sequence[torch.Tensor | None],
        weights: Sequence[torch.Tensor],
        offsets: Sequence[int],
        budget: DeviceBudget | None,
        pad_bytes: int | None = None,
    ) -> list[CountedRows] | None:
        """Mark ``recorded``, then deduplicate and gather every table's rows without waiting.

        Each table's flagged rows are compacted into a buffer as long as its bound
        (:meth:`bounds`: a length the host knows), counted on the device and gathered with the
        padding (which gathers row 0); the counts go to host memory behind one event, and the
        dump worker cuts each buffer to its count (:class:`CountedRows`). No host
        synchronization, about six CUDA calls a table. None, with ``recorded`` marked and
        nothing else done, where the bounds are not known yet, their padding is over
        ``pad_bytes`` (default :data:`COUNTED_PAD_BYTES`) or ``budget`` has no room for the
        buffers: then :meth:`queue` takes the dump.

        Args:
            recorded: per table, any-shaped integer ids (None: none recorded).
            weights: the tables, in order (rows read at the call, in stream order).
            offsets: each table's serving key of its row 0.
            budget: the device staging budget the buffers are charged to (None: not charged;
                warming up).
            pad_bytes: the most bytes of padding allowed.
        """
        for i, ids in enumerate(recorded):
            if ids is not None:
                self.mark(i, ids)
        bounds = self.bounds()
        if bounds is None or not any(bounds):
            return None
        row_bytes = [int(w.shape[1]) * w.element_size() + 8 for w in weights]
        limit = COUNTED_PAD_BYTES if pad_bytes is None else pad_bytes
        pad = sum(min(s, b) * r for s, b, r in zip(self.since, bounds, row_bytes, strict=True))
        if limit <= 0 or pad > limit:
            return None
        shares = [b * r for b, r in zip(bounds, row_bytes, strict=True)]
        staged = sum(b > 0 for b in bounds)
        if budget is not None and not budget.try_take_quietly(self.device, sum(shares), staged):
            return None
        out: list[CountedRows] = []
        counts = torch.empty(len(self.rows), dtype=torch.int64, pin_memory=self.ready is not None)
        for i, (w, block, bound) in enumerate(zip(weights, self.blocks, bounds, strict=True)):
            unique = torch.nonzero_static(block, size=bound, fill_value=-1).view(-1)
            torch.sum(unique >= 0, dim=0, out=self._counts[i])
            values = w.detach().index_select(0, unique.clamp_(min=0))
            keys = unique + offsets[i] if offsets[i] else unique
            out.append(CountedRows(keys, values, upserts(bound), budget=budget))
            out[-1].device_bytes = shares[i] if budget is not None else 0
            out[-1].counts, out[-1].table = counts, i
        self.bitmap.zero_()  # in stream order: after the compactions, before the next marks
        counts.copy_(self._counts, non_blocking=True)
        event = torch.cuda.Event() if self.ready is not None else None
        if event is not None:
            event.record(current_stream(self.device))
        for got in out:
            got.gathered = event
        self._cleared()
        return out

    def _cleared(self) -> None:
        """Every flag is clear (the bitmap was compacted and zeroed, or swapped for a clear one)."""
        self.marked = [0] * len(self.rows)
        self.known, self.since = [0] * len(self.rows), [0] * len(self.rows)
        self._count_pending = False

    def warm_up(self, weights: Sequence[torch.Tensor]) -> None:
        """Deduplicate one id per table and gather its row once (before training), both ways.

        A dump's first calls otherwise load their kernels and allocate on the training thread.
        """
        one = torch.zeros(1, dtype=torch.int64, device=self.device)
        if self.counting:
            for i in range(len(self.rows)):
                self.mark(i, one)
            self.count_marks()
            if self._counted is not None:
                self._counted.synchronize()
            ones = [1] * len(weights)
            for rows in self.gather_counted([None] * len(ones), weights, ones, None) or []:
                rows.resolve()
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


__all__ = ["BATCH_ROWS_MAX", "COUNTED_PAD_BYTES", "BatchedIds", "UniqueBatch"]
