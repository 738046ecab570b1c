"""A dump's deduplication and gather of several CUDA tables as one CUDA graph replay.

The exact path of a dump (:class:`~deltarec.tracking.unique.UniqueBatch`) makes about ten CUDA
calls per table on the training thread and waits once for the deduplication, so that each
staging buffer is exactly as long as the table's touched rows. On a host where a CUDA call
costs 20-60 µs of Python and driver time that is about 1 ms per dump: half a 2 ms training
step. Here the same device work is captured once into a CUDA graph over buffers of a fixed
**capacity** of ids per table (a power of two), and a dump is, on the training thread:

1. every table's recorded ids copied into the graph's input buffer, each table's followed by
   its row count (an id no row has) up to its capacity: one ``torch.cat``;
2. one graph replay, on the training stream: per table the recorded ids are deduplicated
   (sorted and the first of each run kept, or marked in a bitmap of the table's rows when the
   table is small next to the capacity), the unique ids compacted to the front of a buffer of
   the capacity (``torch.nonzero_static``: a length the host knows), the rows of those ids
   gathered into a staging buffer of the capacity (the padding gathers row 0), the keys
   offset, and every table's count of unique ids copied to pinned host memory;
3. one event recorded behind it.

Nothing waits on the host. The dump worker waits for the event, reads the counts, and copies
each table's first ``count`` rows to host memory (:class:`GraphedRows`, a
:class:`~deltarec.tracking.gather.DeviceRows` whose length is known after :meth:`resolve`), so
the rows written are exactly those of the exact path.

A group of tables keeps two captured sets (:class:`GraphedSet`), used in turn: a set is busy
from its replay until the worker has copied every table's rows out of it. A dump that finds
both busy, or whose tables recorded more ids than the capacity, takes the exact path. The sets
are captured once, when the dumper starts (on the training thread, before training runs): a
capture while training runs would be invalidated by any device synchronization or random
number the training makes meanwhile (``cudaStreamBeginCapture`` forbids the first; torch's CUDA
generator refuses the second). So the capacity is chosen then, from a byte limit
(``DumperConfig.device_graph_bytes``), the same number of ids for every table. The padding
costs device time at every replay (the capacity's rows are gathered, ``count`` of them copied
out): at ~3 TB/s about 0.1 ms for a set of 256 MiB.

Plain torch only, like :mod:`deltarec.tracking.gather`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch

from deltarec.tracking.gather import CountedRows, current_stream, upserts

log = logging.getLogger(__name__)

GRAPH_MIN_IDS = 1024
"""The smallest capacity of a table's buffers (ids)."""

GRAPH_MAX_BYTES = 256 << 20
"""The default limit of one :class:`GraphedSet`'s buffers, over all its tables (and at most
1/256 of the device's memory: :func:`default_set_bytes`).

The padding's gather costs device time at every dump: at about 3 TB/s, 256 MiB of rows are
~0.1 ms, against ~0.7 ms of training-thread time the exact path's calls take."""

SORT_RATIO = 32
"""A table sorts its ids when it has more than this many rows per id of capacity; otherwise it
marks them in a bitmap of its rows (a pass over every row: cheaper only for small tables)."""


def default_set_bytes(device: torch.device) -> int:
    """The byte limit of a set on ``device`` when none is configured (see GRAPH_MAX_BYTES)."""
    return min(GRAPH_MAX_BYTES, torch.cuda.get_device_properties(device).total_memory // 256)


def capacity_within(weights: Sequence[torch.Tensor], limit: int) -> int:
    """The largest capacity (ids per table, a power of two) whose set fits ``limit`` bytes.

    0 if not even :data:`GRAPH_MIN_IDS` ids per table fit.
    """
    cap = GRAPH_MIN_IDS
    if set_bytes(weights, [cap] * len(weights)) > limit:
        return 0
    while set_bytes(weights, [2 * cap] * len(weights)) <= limit:
        cap *= 2
    return cap


def set_bytes(weights: Sequence[torch.Tensor], caps: Sequence[int]) -> int:
    """Device bytes of a :class:`GraphedSet` of these capacities (buffers, not scratch)."""
    total = 0
    for w, cap in zip(weights, caps, strict=True):
        row = int(w.shape[1]) * w.element_size()
        total += cap * (row + 8 + 8)  # rows, keys, recorded ids
        if int(w.shape[0]) <= SORT_RATIO * cap:
            total += int(w.shape[0]) + 1  # the bitmap
    return total


class GraphedSet:
    """One capture: per table an input, key and row buffer of its capacity, and the graph.

    On a CPU device (tests of the body and the buffers' layout) nothing is captured: each
    :meth:`run` runs the body eagerly.

    Args:
        weights: the tables (``[rows, dim]`` CUDA tensors, updated in place by training).
        offsets: each table's serving key of its row 0.
        caps: each table's capacity in ids.
    """

    def __init__(
        self, weights: Sequence[torch.Tensor], offsets: Sequence[int], caps: Sequence[int]
    ) -> None:
        self.weights = [w.detach() for w in weights]
        self.offsets = [int(o) for o in offsets]
        self.caps = [int(c) for c in caps]
        self.device = self.weights[0].device
        self.nbytes = set_bytes(self.weights, self.caps)
        dev = self.device
        self.rows_of = [int(w.shape[0]) for w in self.weights]
        # every table's recorded ids side by side, each table's followed by its row count up
        # to its capacity (an id no row has): one ``torch.cat`` writes all of it at a dump
        self.ids = torch.empty(sum(self.caps), dtype=torch.int64, device=dev)
        at = [sum(self.caps[:i]) for i in range(len(self.caps))]
        self.inputs = [self.ids[a : a + c] for a, c in zip(at, self.caps, strict=True)]
        self.fills = [torch.full((c,), r, dtype=torch.int64, device=dev)
                      for c, r in zip(self.caps, self.rows_of, strict=True)]  # fmt: skip
        for ids, fill in zip(self.inputs, self.fills, strict=True):
            ids.copy_(fill)
        self.no_ops = [upserts(c) for c in self.caps]
        self.bitmaps = [
            torch.zeros(r + 1, dtype=torch.bool, device=dev) if r <= SORT_RATIO * c else None
            for c, r in zip(self.caps, self.rows_of, strict=True)
        ]
        self.keys = [torch.empty(c, dtype=torch.int64, device=dev) for c in self.caps]
        self.rows = [
            torch.empty(c, int(w.shape[1]), dtype=w.dtype, device=dev)
            for c, w in zip(self.caps, self.weights, strict=True)
        ]
        self.counts = torch.zeros(len(self.caps), dtype=torch.int64, device=dev)
        cuda = dev.type == "cuda"
        self.host_counts = torch.zeros(len(self.caps), dtype=torch.int64, pin_memory=cuda)
        self.graph = torch.cuda.CUDAGraph() if cuda else None
        self.ready = torch.cuda.Event() if cuda else None
        self._lock = threading.Lock()
        self._held = 0  # tables of the last replay not yet released

    def _body(self) -> None:
        """The device work of one dump (run once eagerly, then captured)."""
        for i, (cap, rows) in enumerate(zip(self.caps, self.rows_of, strict=True)):
            ids = self.inputs[i]
            bitmap = self.bitmaps[i]
            if bitmap is not None:
                bitmap.index_fill_(0, ids, True)  # the row count marks the spare last flag
                unique = torch.nonzero_static(bitmap[:rows], size=cap, fill_value=-1).view(-1)
                torch.sum(unique >= 0, dim=0, out=self.counts[i])
                bitmap.zero_()
                unique.clamp_(min=0)
            else:
                ordered = torch.sort(ids).values  # the row count sorts last
                first = torch.empty(cap, dtype=torch.bool, device=self.device)
                first[:1].fill_(True)
                torch.ne(ordered[1:], ordered[:-1], out=first[1:])
                first.logical_and_(ordered < rows)
                torch.sum(first, dim=0, out=self.counts[i])
                at = torch.nonzero_static(first, size=cap, fill_value=0).view(-1)
                unique = ordered.index_select(0, at).clamp_(max=rows - 1)
            torch.index_select(self.weights[i], 0, unique, out=self.rows[i])
            torch.add(unique, self.offsets[i], out=self.keys[i])
        self.host_counts.copy_(self.counts, non_blocking=True)

    def capture(self) -> None:
        """Run the body once, then capture it (on a stream of its own; nothing on CPU)."""
        if self.graph is None:
            return
        with torch.cuda.device(self.device):
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._body()  # loads the kernels outside the capture
                self.graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self._body()
                finally:
                    self.graph.capture_end()
            stream.synchronize()

    def fits(self, counts: Sequence[int]) -> bool:
        """Whether every table's recorded ids fit its capacity."""
        return all(n <= c for n, c in zip(counts, self.caps, strict=True))

    @property
    def free(self) -> bool:
        """Whether no table of the last replay is still being copied out."""
        with self._lock:
            return self._held == 0

    def run(
        self, recorded: Sequence[Sequence[torch.Tensor]], counts: Sequence[int]
    ) -> list[GraphedRows]:
        """Replay the graph on ``recorded`` (per table, its id tensors; training thread).

        Returns one :class:`GraphedRows` per table; the set is busy until each is released.
        """
        pieces: list[torch.Tensor] = []
        for parts, n, cap, fill in zip(recorded, counts, self.caps, self.fills, strict=True):
            pieces += parts
            if n < cap:
                pieces.append(fill[: cap - n] if n else fill)
        torch.cat(pieces, out=self.ids)
        with self._lock:
            self._held = len(self.caps)
        if self.graph is None:
            self._body()
        else:
            assert self.ready is not None
            self.graph.replay()
            self.ready.record(current_stream(self.device))
        return [GraphedRows.of(self, i) for i in range(len(self.caps))]

    def _release_one(self) -> None:
        with self._lock:
            self._held -= 1


class GraphedRows(CountedRows):
    """One table's rows of a :class:`GraphedSet` replay, in the set's buffers.

    Until :meth:`resolve` the tensors are the whole buffers (the capacity); afterwards their
    first ``count`` entries: the table's unique touched rows in ascending key order.
    """

    owner: GraphedSet | None = None

    @classmethod
    def of(cls, owner: GraphedSet, table: int) -> GraphedRows:
        """Table ``table``'s rows of ``owner``'s last replay."""
        rows = cls(owner.keys[table], owner.rows[table], owner.no_ops[table], gathered=owner.ready)
        rows.owner, rows.counts, rows.table = owner, owner.host_counts, table
        return rows

    def release(self) -> None:
        """Hand the table's buffers back to the set (idempotent); its copies must be done."""
        owner, self.owner = self.owner, None
        if owner is not None:
            self.keys = self.keys.new_empty(0)
            self.rows = self.rows.new_empty((0, int(self.rows.shape[1])))
            self.ops = self.ops[:0]
            owner._release_one()


class GraphedGather:
    """The graphed dumps of one group of CUDA tables: two sets of one capacity, in turn.

    Construct it before training runs (on the training thread): it captures both sets. The
    first capture in a process also loads CUDA's graph machinery (about 100 ms on an H200 host).

    Args:
        weights: the group's tables, all on one CUDA device.
        offsets: each table's serving key of its row 0.
        limit: bytes one set's buffers may take (see :func:`capacity_within`).

    Attributes:
        capacity: ids per table of each set (0: no set fits the limit, or graphs do not work
            here: every dump takes the exact path).
        runs: dumps that took the graph; ``misses``: dumps that could not (both sets busy, or
            more ids than the capacity).
    """

    SETS = 2

    def __init__(self, weights: Sequence[torch.Tensor], offsets: Sequence[int], limit: int) -> None:
        self.weights = [w.detach() for w in weights]
        self.device = self.weights[0].device
        self.capacity = capacity_within(self.weights, limit)
        self.sets: list[GraphedSet] = []
        self.runs = self.misses = 0
        if self.capacity == 0:
            return
        try:
            for _ in range(self.SETS):
                s = GraphedSet(self.weights, offsets, [self.capacity] * len(self.weights))
                s.capture()
                self.sets.append(s)
        except Exception:  # out of memory, or no stream capture here: the exact path remains
            log.warning(
                "capturing the dump graphs failed; dumps take the exact path", exc_info=True
            )
            self.sets, self.capacity = [], 0

    @property
    def nbytes(self) -> int:
        """Device bytes the sets' buffers hold."""
        return sum(s.nbytes for s in self.sets)

    def try_run(self, recorded: Sequence[Sequence[torch.Tensor]]) -> list[GraphedRows] | None:
        """Replay a free set on ``recorded`` (per table, its id tensors); None: not now.

        None means the caller takes the exact path (nothing recorded, no set, both busy, more
        ids than the capacity, or ids on another device).
        """
        if not self.sets or not any(recorded):
            return None  # nothing recorded: the exact path queues nothing either
        if all(parts[0].device == self.device for parts in recorded if parts):
            counts = [sum(int(p.numel()) for p in parts) for parts in recorded]
            if max(counts) <= self.capacity:
                for s in self.sets:
                    if s.free:
                        self.runs += 1
                        return s.run(recorded, counts)
        self.misses += 1
        return None

    def close(self) -> None:
        """Drop the sets (their buffers are freed once no rows of theirs are held)."""
        self.sets = []
