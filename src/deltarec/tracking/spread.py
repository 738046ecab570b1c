"""A dump's rows read over the training steps after it, copy on write (``spread_steps``).

At a dump step the exact path gathers every touched row of a device's tables at once, and the
training thread waits for the deduplication's count first: on a 2 ms step the gather of a few
million rows and that wait are several steps' worth of device and host time in one step. A
spread dump instead keeps, per group of tables, the bitmap of the rows the steps since the
last dump touched (the dump's **pending** rows: touched, not read yet) and reads them over the
steps that follow:

* **copy on write.** Every lookup recorded while the window is open (the tracker records a
  lookup in the step's forward, before the update its backward queues on the same stream)
  reads the looked-up rows with a mask of those still pending, then clears their flags. The
  update that follows changes only rows already read.
* **in the background.** After each step the next ranges of rows (:data:`RANGE_ROWS` each, in
  row order) are compacted to the count the dump step took of them (``nonzero_static``: a
  length the host knows), gathered and cleared, until the step's share of the dump's rows
  (its rows over ``spread_steps``) is read. A range the window reaches after copies on write
  cleared some of its rows is padded, and the padding masked out.

Every read comes with its mask (a key looked up twice in a step is masked after its first
read); the host keeps only rows that were pending when read
(:meth:`~deltarec.tracking.gather.HostRows.wait`), so each touched row is written once, with its
value at the dump step. Nothing waits on the host: the per-range counts come to
pinned memory behind an event that the following steps query.

What this rests on: between dumps, a table's rows change only through lookups that are
recorded before the update (torchrec's tracker and :class:`~deltarec.tracking.lookups.
LookupRecorder` record at the lookup; a :class:`~deltarec.tracking.tracker.ManualTracker` must
be fed before the step's backward), the same rows the exact path relies on.

Plain torch only, like :mod:`deltarec.tracking.gather`; on CPU the same path runs eagerly
(tests).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from deltarec.tracking.device_budget import DeviceBudget
from deltarec.tracking.gather import DeviceRows, HostRows, current_stream, upserts
from deltarec.tracking.pinned import PinnedRing, copy_engine

RANGE_ROWS = 1 << 18
"""Rows of the bitmap one count covers: the unit the background reads take."""

MIN_STEP_ROWS = 1 << 16
"""Rows a step reads at least: each read costs the training thread a dozen device calls and
the worker a wake-up, so a small dump is read in a few steps, not in ``spread_steps``."""

MAX_STEP_ROWS = 1 << 18
"""Rows a step reads at most, whatever ``spread_steps`` asks: a step's read allocates its
buffers on the device, and reads of 0.5-1 GB made the first step after a dump of 15-65 M rows
2.2x a 20 ms step on an H100 (buffers of a few hundred MB: no such step)."""

FINISH_READ_ROWS = 1 << 22
"""Rows of one read when what is left is read at once (bounds its device memory)."""


def _row_bytes(rows: torch.Tensor) -> int:
    """Device bytes a read row takes: its values, its key and its mask flag."""
    return int(rows.shape[1]) * rows.element_size() + 9


def range_counts_buffer(pending: Sequence[torch.Tensor]) -> torch.Tensor:
    """A host buffer for the per-range counts of a window over ``pending`` (pinned on CUDA)."""
    n = sum(math.ceil(int(p.numel()) / RANGE_ROWS) for p in pending)
    cuda = pending[0].device.type == "cuda"
    return torch.empty(n, dtype=torch.int64, pin_memory=cuda)


@dataclass
class _Range:
    member: int
    start: int
    stop: int


class SpreadWindow:
    """One dump's pending rows of a group of tables, read over the steps after the dump.

    Args:
        weights: the group's tables (updated in place by training).
        offsets: each table's serving key of its row 0.
        pending: per table, a bool flag per row: the rows the dump holds (taken over).
        steps: the steps the background reads are spread over.
        budget: the device staging budget the reads are charged to (None: host memory).
        ring: pinned host memory for reads that do not fit the budget (None: torch's).
        chunk_rows: rows per host chunk where a read goes to host memory.
        host_counts: the pinned buffer the per-range counts come to (:func:`range_counts_buffer`;
            allocating pinned memory takes milliseconds: a group keeps one for its windows).
    """

    def __init__(
        self,
        weights: Sequence[torch.Tensor],
        offsets: Sequence[int],
        pending: Sequence[torch.Tensor],
        steps: int,
        budget: DeviceBudget | None = None,
        ring: PinnedRing | None = None,
        chunk_rows: int = 1 << 16,
        host_counts: torch.Tensor | None = None,
    ) -> None:
        self.weights = [w.detach() for w in weights]
        self.offsets = [int(o) for o in offsets]
        self.pending = list(pending)
        self.steps = max(1, int(steps))
        self.budget, self.ring, self.chunk_rows = budget, ring, chunk_rows
        self.device = self.weights[0].device
        self.cuda = self.device.type == "cuda"
        # where reads may stay on the device; else they go to host memory chunk by chunk
        self.staging = budget is not None and self.cuda and budget.capacity(self.device) > 0
        self.ranges = [
            _Range(m, a, min(a + RANGE_ROWS, int(p.numel())))
            for m, p in enumerate(self.pending)
            for a in range(0, int(p.numel()), RANGE_ROWS)
        ]
        counts = []
        for p in self.pending:
            full = int(p.numel()) // RANGE_ROWS * RANGE_ROWS
            if full:
                counts.append(p[:full].view(-1, RANGE_ROWS).sum(1))
            if full < int(p.numel()):
                counts.append(p[full:].sum(0, keepdim=True))
        if host_counts is None or host_counts.numel() != len(self.ranges):
            host_counts = range_counts_buffer(self.pending)
        self.host_counts = host_counts
        self.host_counts.copy_(torch.cat(counts), non_blocking=self.cuda)
        self._ready: torch.cuda.Event | None = None
        if self.cuda:
            self._ready = torch.cuda.Event()
            self._ready.record(current_stream(self.device))
        self.counts: list[int] | None = None
        self.rows = 0  # pending rows at the dump step, once the counts are known
        self.cursor = 0
        self.copied: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = [
            [] for _ in self.weights
        ]
        self.closed = False
        self.completed = False
        """Every pending row was read: each flag of ``pending`` is clear again."""

    @property
    def done(self) -> bool:
        """Whether every pending row was read (and the window is closed)."""
        return self.closed

    def on_lookup(self, member: int, ids: torch.Tensor) -> None:
        """Read the rows ``ids`` looks up that are still pending, before the step updates them.

        Called as a lookup is recorded (the step's forward). Queues three device calls on the
        current stream; nothing waits.
        """
        if self.closed:
            return
        flat = ids.reshape(-1)
        if flat.numel() == 0:
            return
        if flat.dtype != torch.int64 or flat.device != self.device:
            flat = flat.to(self.device, torch.int64)
        pending = self.pending[member]
        valid = pending.index_select(0, flat)
        rows = self.weights[member].index_select(0, flat)
        pending.index_fill_(0, flat, False)
        self.copied[member].append((flat, rows, valid))

    def _known(self, wait: bool) -> bool:
        if self.counts is None:
            if self._ready is not None and not wait and not self._ready.query():
                return False
            if self._ready is not None:
                self._ready.synchronize()
            self.counts = self.host_counts.tolist()
            self.rows = sum(self.counts)
        return True

    def advance(self, finish: bool = False) -> Iterator[tuple[int, HostRows]]:
        """Read this step's share of the pending rows, yielding ``(table, rows)`` to write.

        Each piece is yielded as soon as it is read: the caller hands it on before the next is
        read (pieces read into host memory wait for ring slots that only their writing frees).

        Args:
            finish: read every row still pending now (the next dump, a checkpoint, the end),
                beyond the step's share and the device budget; the window closes.

        Yields:
            Per table position, rows read (a :class:`DeviceRows` staging buffer on CUDA where
            the budget has room, else host chunks), each with the mask of the rows kept.
        """
        if self.closed:
            return
        yield from self._copies()
        if not self._known(wait=finish):
            return
        assert self.counts is not None
        share = min(max(MIN_STEP_ROWS, math.ceil(self.rows / self.steps)), MAX_STEP_ROWS)
        most = FINISH_READ_ROWS if finish else share  # rows of one read
        taken = 0
        while self.cursor < len(self.ranges) and (finish or taken < share):
            first = self.ranges[self.cursor]
            stop, n = self.cursor, 0
            while (
                stop < len(self.ranges)
                and self.ranges[stop].member == first.member
                and (n == 0 or n + self.counts[stop] <= most)
            ):
                n += self.counts[stop]
                stop += 1
            if n:
                read = self._read(first.member, first.start, self.ranges[stop - 1].stop, n, finish)
                if read is None:
                    return  # no device room now: the next steps go on
                yield from read
            self.cursor, taken = stop, taken + n
        if self.cursor >= len(self.ranges):
            yield from self._copies()
            self.completed = True
            self.close()

    def _copies(self) -> Iterator[tuple[int, HostRows]]:
        """The copies on write recorded since the last call, one piece per table.

        A key the step looked up more than once (in one lookup, or in two: the second reads
        it as no longer pending) is kept once: its first read, by a stable sort of the ids.
        """
        for member, parts in enumerate(self.copied):
            if not parts:
                continue
            self.copied[member] = []
            ids, rows, valid = (
                torch.cat(t) if len(t) > 1 else t[0] for t in zip(*parts, strict=True)
            )
            ordered, order = torch.sort(ids, stable=True)
            repeat = torch.zeros_like(valid)
            repeat[order[1:]] = ordered[1:] == ordered[:-1]
            valid = valid & ~repeat
            held = 0
            if self.staging:  # a few lookups' rows: always staged
                assert self.budget is not None
                held = int(ids.shape[0]) * _row_bytes(rows)
                self.budget.force_take(self.device, held)
            yield from self._place(member, ids + self.offsets[member], rows, valid, held)

    def _read(
        self, member: int, start: int, stop: int, n: int, finish: bool
    ) -> Iterator[tuple[int, HostRows]] | None:
        """Read the pending rows of ``[start, stop)`` (``n`` at the dump step) and clear them.

        None: the device budget has no room for them now (only when not ``finish``).
        """
        weight = self.weights[member]
        held = 0
        if self.staging:
            assert self.budget is not None
            nbytes = n * _row_bytes(weight)
            if self.budget.try_take_quietly(self.device, nbytes):
                held = nbytes
            elif not finish:
                return None
        span = self.pending[member][start:stop]
        at = torch.nonzero_static(span, size=n, fill_value=-1).view(-1)
        valid = at.ge(0)
        ids = at.clamp_(min=0).add_(start)
        rows = weight.index_select(0, ids)
        span.zero_()
        return self._place(member, ids.add_(self.offsets[member]), rows, valid, held)

    def _place(
        self, member: int, keys: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, held: int
    ) -> Iterator[tuple[int, HostRows]]:
        """Hand read rows on.

        On CPU as they are; on CUDA staged (``held`` bytes taken) or copied to host memory
        chunk by chunk.
        """
        n = int(keys.shape[0])
        if not self.cuda:
            yield member, HostRows(keys, rows, torch.zeros(n, dtype=torch.int8), valid=valid)
            return
        if held:
            event = torch.cuda.Event()
            event.record(current_stream(self.device))
            ops = upserts(n)
            yield (
                member,
                DeviceRows(
                    keys,
                    rows,
                    ops,
                    gathered=event,
                    budget=self.budget,
                    device_bytes=held,
                    valid=valid,
                ),
            )
            return
        eng = copy_engine(self.device)
        for a in range(0, n, self.chunk_rows):
            part = [t[a : a + self.chunk_rows] for t in (keys, rows, valid)]
            (hk, hr, hv), copied, slot = eng.to_host(*part, ring=self.ring, keep_one=True)
            ops = torch.zeros(int(hk.shape[0]), dtype=torch.int8)
            yield member, HostRows(hk, hr, ops, copied, tuple(part), slot, valid=hv)

    def close(self) -> None:
        """Stop copying on write (idempotent): the window's rows are all read, or dropped."""
        self.closed = True
        self.copied = [[] for _ in self.weights]


def warm_up_spread(weights: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """Run a spread dump of one row per table once, before training (untimed).

    A window's first copy on write and read otherwise load their kernels (the sort among
    them) on the training thread in the first steps after the first dump.
    """
    device = weights[0].device
    pending = []
    for w in weights:
        flags = torch.zeros(min(int(w.shape[0]), 2), dtype=torch.bool, device=device)
        flags[0] = True
        pending.append(flags)
    window = SpreadWindow([w[: int(p.numel())] for w, p in zip(weights, pending, strict=True)],
                          offsets, pending, 1)  # fmt: skip
    for member in range(len(weights)):
        window.on_lookup(member, torch.zeros(2, dtype=torch.int64, device=device))
    for _, rows in window.advance(finish=True):
        rows.wait()
