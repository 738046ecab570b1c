"""The device side of a dump, on plain torch tensors: dedup, gather, device→host copy.

Nothing here imports torchrec, so the same path runs on CUDA machines without it and in the
CUDA benchmark. On CUDA the gathered rows are copied to pinned host memory on a dedicated copy
stream: the gather of chunk ``k + 1`` overlaps the copy of chunk ``k``, and each host chunk
carries an event the background worker waits on before it reads the bytes. On CPU the gather
already produces a host tensor and no copy is made.

Inside the dumper the pinned memory is a :class:`~deltarec.tracking.pinned.PinnedRing`, allocated
once when the dumper starts and reused; the copies run on the device's copy engine
(:mod:`deltarec.tracking.pinned`). Outside a ring (direct calls) chunks are pinned one by one
through torch's caching host allocator.

Inside a :func:`~deltarec.tracking.device_budget.device_staging` block (the dumper's), a CUDA
table's rows are instead gathered at once into a device staging buffer (:class:`DeviceRows`)
when the block's budget has room: the training thread then waits only for the device, and the
dump worker copies the buffer to host memory chunk by chunk (:meth:`DeviceRows.to_host`).

Typical use (training thread)::

    ids = dedup_ids(touched_local_rows)              # sorted, unique, on the table's device
    for chunk in gather_to_host(weight, ids, chunk_rows=65536, key_offset=row_offset):
        queue.put(chunk, chunk.nbytes)               # the worker calls chunk.wait() first
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from deltarec.tracking.device_budget import DeviceBudget, current_budget, current_ring
from deltarec.tracking.pinned import PinnedRing, PinnedSlot, copy_engine, slot_bytes

_BITMAP_PER_ID = 16
_BITMAP_MIN_ROWS = 1 << 16


def dedup_ids(ids: torch.Tensor, num_rows: int | None = None) -> torch.Tensor:
    """Sorted unique int64 ids, on the device the ids live on.

    With ``num_rows`` given and small next to the number of ids (at most 16 flags per id, or
    64k rows), the ids are deduplicated by marking a bitmap of ``num_rows`` flags: linear,
    and on CPU 10-100x faster than the sort behind ``torch.unique``.

    Args:
        ids: any-shaped integer tensor of row indices (duplicates allowed).
        num_rows: the table's row count (every id in ``[0, num_rows)``), or None.

    Returns:
        1-D int64 tensor, ascending, without duplicates.
    """
    flat = ids.reshape(-1)
    if flat.dtype != torch.int64:
        flat = flat.to(torch.int64)
    if flat.numel() == 0:
        return flat
    if num_rows is not None and num_rows <= _BITMAP_PER_ID * flat.numel() + _BITMAP_MIN_ROWS:
        seen = torch.zeros(num_rows, dtype=torch.bool, device=flat.device)
        seen[flat] = True
        return seen.nonzero().reshape(-1)
    return torch.unique(flat, sorted=True)


@dataclass
class HostRows:
    """A chunk of gathered rows in host memory (pinned on CUDA), ready to encode.

    Attributes:
        keys: int64 ``[n]`` serving keys.
        rows: float ``[n, dim]`` values (a host tensor; pinned when copied from CUDA).
        ops: int8 ``[n]``.
        event: CUDA event recorded after the copy; None for CPU tables.
        keepalive: device tensors that must outlive the asynchronous copy.
        slot: the :class:`PinnedRing` slot the tensors lie in (None: memory of their own);
            given back by :meth:`free`, after which the tensors must not be read.
        valid: bool ``[n]``, the rows to keep (None: all): a spread dump's reads
            (:mod:`deltarec.tracking.spread`) carry rows read after their flag was cleared and
            padding; :meth:`wait` keeps the valid rows.
    """

    keys: torch.Tensor
    rows: torch.Tensor
    ops: torch.Tensor
    event: torch.cuda.Event | None = None
    keepalive: tuple[torch.Tensor, ...] = ()
    slot: PinnedSlot | None = None
    valid: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    @property
    def nbytes(self) -> int:
        """Host bytes this chunk takes on the dump path.

        The rows, keys and ops, and their encoded copy (the parquet piece: at most the rows
        again, key, op and step, an int8 row's scale and bias, a repetition level bit per
        value). Rows in a :class:`PinnedRing` slot count only their encoded copy: the ring's
        memory is taken out of the budget once, when the dumper plans it.
        """
        return _budget_bytes(self.rows, self.slot is not None)

    def free(self) -> None:
        """Give the chunk's ring slot back (idempotent; no-op without one).

        Call it once nothing reads the host tensors any more (the worker does, when the
        chunk's bytes are written and hashed).
        """
        slot, self.slot = self.slot, None
        if slot is not None:
            slot.give_back()

    def wait(self) -> None:
        """Block until the device→host copy has finished (no-op on CPU).

        Then keep the valid rows, each key once (see ``valid``).
        """
        if self.event is not None:
            self.event.synchronize()
            self.event = None
            self.keepalive = ()
        if self.valid is not None:
            self._keep_valid()

    def _keep_valid(self) -> None:
        """Move the valid rows to the front of the tensors, in place.

        In place, so rows in a :class:`PinnedRing` slot stay there (the encoder process reads
        them from the ring).
        """
        valid, self.valid = self.valid, None
        assert valid is not None
        keep = valid.to(torch.bool)
        n = int(keep.sum())
        if n == int(keep.numel()):
            return
        self.keys[:n] = self.keys[keep]
        self.rows[:n] = self.rows[keep]
        self.keys, self.rows, self.ops = self.keys[:n], self.rows[:n], self.ops[:n]

    def numpy(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(keys, rows, ops)`` as numpy arrays on the host memory (after :meth:`wait`)."""
        return self.keys.numpy(), self.rows.numpy(), self.ops.numpy()


def _budget_bytes(rows: torch.Tensor, pinned: bool = False) -> int:
    n, dim = int(rows.shape[0]), int(rows.shape[1]) if rows.dim() > 1 else 1
    copies = 1 if pinned else 2  # the rows' host copy lies in the ring's memory
    return copies * n * dim * rows.element_size() + n * (50 + (dim + 7) // 8)


@dataclass
class DeviceRows(HostRows):
    """A table's gathered rows in a device staging buffer, copied to host by the dump worker.

    ``keys``, ``rows`` and ``ops`` are on the device until :meth:`wait` (the whole buffer at
    once) or :meth:`release`; the dump worker instead copies it chunk by chunk with
    :meth:`to_host`. It takes no host bytes (``nbytes`` is 0) but ``device_bytes`` of
    ``budget`` until :meth:`release` (or :meth:`wait`).

    Attributes:
        gathered: recorded on the producing stream after the gather.
        budget: the budget the buffer is charged to.
        device_bytes: bytes charged (0 once given back).
    """

    gathered: torch.cuda.Event | None = None
    budget: DeviceBudget | None = None
    device_bytes: int = 0

    @property
    def nbytes(self) -> int:
        """No host bytes: the buffer is charged to the device budget."""
        return 0

    def resolve(self) -> None:
        """Learn the buffer's length where it was not known when queued (here it always is).

        The dump worker calls it before it reads the length; see :class:`CountedRows`.
        """

    def host_bytes(self, start: int, stop: int, ring: PinnedRing | None = None) -> int:
        """Host bytes rows ``start:stop`` take once copied (as :attr:`HostRows.nbytes`).

        With ``ring``: as copied into one of its slots, when they fit one.
        """
        rows = self.rows[start:stop]
        parts = [self.keys[start:stop], rows]
        if self.valid is not None:
            parts.append(self.valid[start:stop])
        pinned = ring is not None and ring.fits(slot_bytes(*parts))
        return _budget_bytes(rows, pinned)

    def to_host(self, start: int, stop: int, ring: PinnedRing | None = None) -> HostRows:
        """Start copying rows ``start:stop`` into pinned host memory (a slot of ``ring``).

        The copy stream first waits for the gather; :meth:`HostRows.wait` completes the copy.
        Taking a slot waits until one is free (the dump worker calls this).
        """
        eng = copy_engine(self.rows.device)
        assert eng.stream is not None and self.gathered is not None
        eng.stream.wait_event(self.gathered)
        keys, rows = self.keys[start:stop], self.rows[start:stop]
        ops = torch.zeros(int(keys.shape[0]), dtype=torch.int8)
        if self.valid is None:
            (hkeys, hrows), event, slot = eng.to_host(keys, rows, wait_current=False, ring=ring)
            return HostRows(hkeys, hrows, ops, event, slot=slot)
        valid = self.valid[start:stop]
        (hkeys, hrows, hvalid), event, slot = eng.to_host(
            keys, rows, valid, wait_current=False, ring=ring
        )
        return HostRows(hkeys, hrows, ops, event, slot=slot, valid=hvalid)

    def wait(self) -> None:
        """Copy the whole buffer to host memory now (for callers that take it as host rows)."""
        if self.keys.device.type == "cpu":
            if self.valid is not None:
                self._keep_valid()
            return
        self.resolve()
        host = self.to_host(0, len(self))
        host.wait()
        self.release()
        self.keys, self.rows, self.ops, self.valid = host.keys, host.rows, host.ops, None

    def release(self) -> None:
        """Give the buffer's bytes back to the budget and drop the device tensors (idempotent)."""
        if self.device_bytes and self.budget is not None:
            device = self.rows.device
            self.keys = self.keys.new_empty(0)
            self.rows = self.rows.new_empty((0, int(self.rows.shape[1])))
            self.ops = self.ops.new_empty(0)
            self.valid = None
            self.budget.give_back(device, self.device_bytes)
            self.device_bytes = 0


class CountedRows(DeviceRows):
    """A table's rows gathered into a buffer longer than them; their count comes later.

    The training thread queued the gather without waiting for the deduplication: the buffers
    hold an upper bound of rows, the table's unique touched rows first (ascending keys), then
    padding. The count is copied to ``counts[table]`` (pinned host memory) before the
    ``gathered`` event; :meth:`resolve` (the dump worker) waits for it and cuts the buffers.
    Used by a group's graphed dumps (:class:`~deltarec.tracking.graphed.GraphedRows`).
    """

    counts: torch.Tensor | None = None
    table: int = 0
    resolved: bool = False

    def resolve(self) -> None:
        """Wait for the gather and cut the buffers to the table's count (worker thread)."""
        if self.resolved or self.counts is None:
            return
        if self.gathered is not None:
            self.gathered.synchronize()
        n = int(self.counts[self.table])
        self.keys, self.rows, self.ops = self.keys[:n], self.rows[:n], self.ops[:n]
        self.resolved = True


def warm_up_gather(weight: torch.Tensor, ids: torch.Tensor) -> None:
    """Do once what a dump's first gather of ``weight`` would (copy stream, kernels), untimed.

    Called before training: on the training thread at the first dump the copy stream's
    creation alone took 4 ms on an H200 host.
    """
    copy_engine(weight.device)
    _ = weight.detach().index_select(0, ids), ids + 1


def rows_to_host(
    keys: torch.Tensor, rows: torch.Tensor, ops: torch.Tensor | None = None
) -> HostRows:
    """Copy already gathered rows (and their keys/ops) to host memory, asynchronously on CUDA.

    Args:
        keys: int64 ``[n]`` on the rows' device (or on the host).
        rows: ``[n, dim]`` values.
        ops: int8 ``[n]`` or None (all upserts).

    Returns:
        A :class:`HostRows` whose :meth:`~HostRows.wait` completes the copy.
    """
    if ops is None:
        ops = torch.zeros(keys.shape[0], dtype=torch.int8, device=keys.device)
    eng = copy_engine(rows.device)
    dev = [keys.to(rows.device), rows.detach().contiguous(), ops.to(rows.device)]
    host, event, slot = eng.to_host(*dev, ring=current_ring(), keep_one=True)
    keep = tuple(dev) if event is not None else ()
    return HostRows(host[0], host[1], host[2], event=event, keepalive=keep, slot=slot)


def gather_to_host(
    weight: torch.Tensor,
    ids: torch.Tensor,
    chunk_rows: int,
    key_offset: int = 0,
    keys: torch.Tensor | None = None,
) -> Iterator[HostRows]:
    """Gather ``weight[ids]`` chunk by chunk and copy each chunk to host memory.

    The values are read when each chunk is gathered: callers that need one consistent step
    consume the whole iterator before the model changes again (the dumper does, on the
    training thread; the byte-bounded queue makes it wait for space, never drop rows).

    Args:
        weight: ``[num_rows, dim]`` table (or local shard) on any device.
        ids: 1-D int64 local row indices on ``weight``'s device (see :func:`dedup_ids`).
        chunk_rows: rows per yielded chunk (>= 1).
        key_offset: added to ``ids`` to form the serving keys (a row-wise shard's offset).
        keys: explicit serving keys (same length as ``ids``) instead of ``ids + key_offset``.

    Yields:
        :class:`HostRows` chunks in ``ids`` order; ``ops`` are all upserts. Inside a
        :func:`~deltarec.tracking.device_budget.device_staging` block with room on a CUDA
        device: one :class:`DeviceRows` with every row instead.
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if weight.requires_grad:  # a live nn.Parameter: read its values, record no autograd graph
        weight = weight.detach()
    n = int(ids.shape[0])
    eng = copy_engine(weight.device)
    budget, ring = current_budget(), current_ring()
    if eng.cuda and budget is not None and n > 0:
        staged = stage_on_device(weight, ids, budget, key_offset, keys, min_rows=chunk_rows)
        if staged is not None:
            yield staged
            done = len(staged)
            if done == n:
                return
            # the rest did not fit the staging buffer: gathered into host memory below
            ids, n = ids[done:], n - done
            keys = keys[done:] if keys is not None else None
    for start in range(0, n, chunk_rows):
        idx = ids[start : start + chunk_rows]
        rows = weight.index_select(0, idx)
        k = idx + key_offset if keys is None else keys[start : start + chunk_rows]
        k = k.to(device=weight.device, dtype=torch.int64)
        ops = torch.zeros(idx.shape[0], dtype=torch.int8, device=weight.device)
        if eng.cuda:
            host, event, slot = eng.to_host(k, rows, ops, ring=ring, keep_one=True)
            yield HostRows(host[0], host[1], host[2], event, (k, rows, ops), slot)
        else:
            yield HostRows(k, rows, ops)


def stage_on_device(
    weight: torch.Tensor,
    ids: torch.Tensor,
    budget: DeviceBudget,
    key_offset: int = 0,
    keys: torch.Tensor | None = None,
    min_rows: int = 1,
) -> DeviceRows | None:
    """Gather ``weight[ids]`` into one device staging buffer, as far as ``budget`` has room.

    Where the rows do not all fit, the first ones that do are staged (at least ``min_rows``)
    and the caller gathers the rest into host memory (:func:`gather_to_host`). Returns None
    (nothing taken) when not even ``min_rows`` fit or the device has no memory left for them.
    """
    if weight.requires_grad:
        weight = weight.detach()
    total = int(ids.shape[0])
    row_bytes = int(weight.shape[1]) * weight.element_size() + 8
    device = weight.device
    n = budget.take_rows(device, total, row_bytes, f"a table of {total} rows", min_rows)
    if n == 0:
        return None
    nbytes = n * row_bytes
    if n < total:
        ids = ids[:n]
        keys = keys[:n] if keys is not None else None
    try:
        # every call here is paid on the training thread at each dump: no more than needed
        rows = weight.index_select(0, ids)
        k = (ids + key_offset if key_offset else ids) if keys is None else keys
        if k.dtype != torch.int64 or k.device != device:
            k = k.to(device=device, dtype=torch.int64)
    except torch.OutOfMemoryError:
        budget.give_back(device, nbytes)
        budget.full += 1
        return None
    # all upserts; the host copy makes its own (to_host), so none is written on the device
    ops = upserts(n)
    event = torch.cuda.Event()
    event.record(current_stream(device))  # the gather's stream
    return DeviceRows(k, rows, ops, gathered=event, budget=budget, device_bytes=nbytes)


def current_stream(device: torch.device | None = None) -> torch.cuda.Stream:
    """The current CUDA stream of ``device`` (None: the current device), asked by index.

    ``Event.record()`` and ``torch.cuda.current_stream()`` without a device resolve it through
    several Python calls, 30-50 µs each on a training host: a dump pays for every one.
    """
    index = device.index if device is not None else None
    return torch.cuda.current_stream(torch.cuda.current_device() if index is None else index)


_NO_OPS = torch.zeros((), dtype=torch.int8)


def upserts(n: int) -> torch.Tensor:
    """The ops of ``n`` device rows that are all upserts: one host scalar expanded, nothing written.

    The host copy makes its own (:meth:`DeviceRows.to_host`), so no device tensor is needed.
    """
    return _NO_OPS.expand(n)
