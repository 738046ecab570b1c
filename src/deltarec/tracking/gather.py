"""The device side of a dump, on plain torch tensors: dedup, gather, device→host copy.

Nothing here imports torchrec, so the same path runs on CUDA machines without it and in the
CUDA benchmark. On CUDA the gathered rows are copied to pinned host memory on a dedicated copy
stream: the gather of chunk ``k + 1`` overlaps the copy of chunk ``k``, and each host chunk
carries an event the background worker waits on before it reads the bytes. On CPU the gather
already produces a host tensor and no copy is made.

Inside the dumper the pinned memory is a :class:`PinnedRing`: slots allocated once, when the
dumper starts, and reused (a chunk's slot is given back once its bytes are written). Pinned
memory is never allocated while training runs: ``cudaHostAlloc`` holds the GIL and the CUDA
driver's lock for 17-56 ms per 32 MiB chunk on an H200 host, which stalled the training
thread's kernel launches for as long. Outside a ring (direct calls) chunks are pinned one by
one through torch's caching host allocator, as before.

Inside a :func:`~deltarec.tracking.staging.device_staging` block (the dumper's), a CUDA table's
rows are instead gathered at once into a device staging buffer (:class:`DeviceRows`) when the
block's budget has room: the training thread then waits only for the device, and the dump
worker copies the buffer to host memory chunk by chunk (:meth:`DeviceRows.to_host`).

Typical use (training thread)::

    ids = dedup_ids(touched_local_rows)              # sorted, unique, on the table's device
    for chunk in gather_to_host(weight, ids, chunk_rows=65536, key_offset=row_offset):
        queue.put(chunk, chunk.nbytes)               # the worker calls chunk.wait() first
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from deltarec.tracking.staging import DeviceBudget, current_budget, current_ring

log = logging.getLogger(__name__)
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
    """

    keys: torch.Tensor
    rows: torch.Tensor
    ops: torch.Tensor
    event: torch.cuda.Event | None = None
    keepalive: tuple[torch.Tensor, ...] = ()
    slot: PinnedSlot | None = None

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
        """Block until the device→host copy has finished (no-op on CPU)."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None
            self.keepalive = ()

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

        The dump worker calls it before it reads the length; see
        :class:`~deltarec.tracking.graphed.GraphedRows`.
        """

    def host_bytes(self, start: int, stop: int, ring: PinnedRing | None = None) -> int:
        """Host bytes rows ``start:stop`` take once copied (as :attr:`HostRows.nbytes`).

        With ``ring``: as copied into one of its slots, when they fit one.
        """
        rows = self.rows[start:stop]
        pinned = ring is not None and ring.fits(_slot_bytes(self.keys[start:stop], rows))
        return _budget_bytes(rows, pinned)

    def to_host(self, start: int, stop: int, ring: PinnedRing | None = None) -> HostRows:
        """Start copying rows ``start:stop`` into pinned host memory (a slot of ``ring``).

        The copy stream first waits for the gather; :meth:`HostRows.wait` completes the copy.
        Taking a slot waits until one is free (the dump worker calls this).
        """
        eng = _engine(self.rows.device)
        assert eng.stream is not None and self.gathered is not None
        eng.stream.wait_event(self.gathered)
        keys, rows = self.keys[start:stop], self.rows[start:stop]
        ops = torch.zeros(int(keys.shape[0]), dtype=torch.int8)
        (hkeys, hrows), event, slot = eng.to_host(
            keys, rows, wait_current=False, ring=ring, paced=True
        )
        return HostRows(hkeys, hrows, ops, event, slot=slot)

    def wait(self) -> None:
        """Copy the whole buffer to host memory now (for callers that take it as host rows)."""
        if self.keys.device.type == "cpu":
            return
        self.resolve()
        host = self.to_host(0, len(self))
        host.wait()
        self.release()
        self.keys, self.rows, self.ops = host.keys, host.rows, host.ops

    def release(self) -> None:
        """Give the buffer's bytes back to the budget and drop the device tensors (idempotent)."""
        if self.device_bytes and self.budget is not None:
            device = self.rows.device
            self.keys = self.keys.new_empty(0)
            self.rows = self.rows.new_empty((0, int(self.rows.shape[1])))
            self.ops = self.ops.new_empty(0)
            self.budget.give_back(device, self.device_bytes)
            self.device_bytes = 0


_ALIGN = 64


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _slot_bytes(*tensors: torch.Tensor) -> int:
    """Bytes of a ring slot that ``tensors`` take, each at a 64-byte boundary."""
    return sum(_aligned(t.numel() * t.element_size()) for t in tensors)


def pinned_slot_bytes(chunk_rows: int, dim: int, value_bytes: int = 4) -> int:
    """Bytes of a :class:`PinnedRing` slot for chunks of ``chunk_rows`` rows of ``dim`` values.

    The keys (int64), rows and ops (int8), each at a 64-byte boundary.
    """
    return (
        _aligned(chunk_rows * 8) + _aligned(chunk_rows * dim * value_bytes) + _aligned(chunk_rows)
    )


class PinnedSlot:
    """One slot of a :class:`PinnedRing` (a view of its pinned buffer), taken until given back."""

    def __init__(self, ring: PinnedRing, buffer: torch.Tensor) -> None:
        self.ring = ring
        self.buffer = buffer

    def carve(self, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Host tensors shaped and typed as ``like``, side by side in the slot."""
        out, at = [], 0
        for t in like:
            n = t.numel() * t.element_size()
            out.append(self.buffer[at : at + n].view(t.dtype).view(t.shape))
            at += _aligned(n)
        return out

    def give_back(self) -> None:
        """Return the slot to its ring."""
        self.ring._give(self.buffer)


class PinnedRing:
    """Pinned host memory allocated once and reused for every device→host copy of a dump.

    ``slots`` slots of ``slot_bytes`` each (one chunk's keys, rows and ops), in one pinned
    buffer allocated by :meth:`allocate` (the dumper calls it when it starts, before training
    runs) or at the first :meth:`take`. A chunk too large for a slot is pinned on its own
    (counted in :attr:`oversize`).

    Two takers share the ring: the dump worker (copies out of device staging buffers) and
    the training thread (tables gathered straight into host memory). The training thread
    never takes the last free slot: the chunks it takes wait in the dump queue, so they
    could otherwise hold every slot while the worker, which alone frees them, waits for one.

    A **shared** ring lies in anonymous shared memory (``memfd_create``) instead, registered
    with CUDA as pinned memory (``cudaHostRegister``) where CUDA is available: another process
    given :attr:`fd` maps the same bytes, and reads a chunk at the ring offsets of its tensors
    (:meth:`offset_of`). The dumper's encoder process does
    (:mod:`deltarec.dump.encoder_process`). The memory has no name: it is freed when the last
    process holding it ends, whatever way it ends.

    Args:
        slot_bytes: bytes per slot (rounded up to 64).
        slots: number of slots (>= 2).
        shared: allocate the ring in shared memory (see above).

    Attributes:
        waits: takes that had to wait for a free slot; ``wait_seconds``: time they waited.
        oversize: chunks too large for a slot.
        fd: the shared memory's file descriptor (-1 until allocated, or not shared).
    """

    def __init__(self, slot_bytes: int, slots: int, shared: bool = False) -> None:
        if slots < 2 or slot_bytes < 1:
            raise ValueError(f"a pinned ring needs >= 2 slots of >= 1 byte, got {slots}")
        self.slot_bytes = _aligned(slot_bytes)
        self.slots = slots
        self.shared = shared
        self.fd = -1
        self._registered = False
        self._free: list[torch.Tensor] = []
        self._buffer: torch.Tensor | None = None
        self._cond = threading.Condition()
        self.waits = 0
        self.wait_seconds = 0.0
        self.oversize = 0

    @property
    def nbytes(self) -> int:
        """Pinned bytes the ring holds (once allocated)."""
        return self.slot_bytes * self.slots

    @property
    def allocated(self) -> bool:
        """Whether the pinned buffer exists."""
        return self._buffer is not None

    def allocate(self) -> None:
        """Allocate the pinned buffer now (idempotent); takes the CUDA driver's lock once."""
        with self._cond:
            if self._buffer is not None:
                return
            started = time.perf_counter()
            if self.shared:
                buf = self._shared_buffer()
            else:
                buf = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
            self._buffer = buf
            self._free = [
                buf[i * self.slot_bytes : (i + 1) * self.slot_bytes] for i in range(self.slots)
            ]
            self._cond.notify_all()
        log.info(
            "%s dump ring: %d slots of %.1f MiB allocated in %.3f s",
            ("shared, pinned" if self._registered else "shared") if self.shared else "pinned",
            self.slots,
            self.slot_bytes / 2**20,
            time.perf_counter() - started,
        )

    def _shared_buffer(self) -> torch.Tensor:
        """The ring's bytes in anonymous shared memory, registered as pinned where CUDA is."""
        fd = os.memfd_create("deltarec-dump-ring", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, self.nbytes)
            mapped = mmap.mmap(fd, self.nbytes)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        buf = torch.frombuffer(mapped, dtype=torch.uint8)
        if torch.cuda.is_available():
            # device->host copies into it then run at pinned speed, asynchronously
            rc = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), self.nbytes, 0)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister of the {self.nbytes}-byte ring: {rc}")
            self._registered = True
        return buf

    def offset_of(self, tensor: torch.Tensor) -> int:
        """Byte offset of ``tensor``'s first element in the ring (a tensor of a slot)."""
        assert self._buffer is not None
        return int(tensor.data_ptr() - self._buffer.data_ptr())

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s bytes lie in the ring."""
        if self._buffer is None or tensor.device.type != "cpu":
            return False
        at = tensor.data_ptr() - self._buffer.data_ptr()
        return at >= 0 and at + tensor.numel() * tensor.element_size() <= self.nbytes

    def close(self) -> None:
        """Unregister and drop the ring's memory (idempotent; no slot may be in use)."""
        with self._cond:
            buf, self._buffer, self._free = self._buffer, None, []
            if buf is not None and self._registered:
                torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
                self._registered = False
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1

    def fits(self, nbytes: int) -> bool:
        """Whether a chunk of ``nbytes`` (:func:`_slot_bytes`) fits one slot."""
        return nbytes <= self.slot_bytes

    def take(self, nbytes: int, keep_one: bool) -> PinnedSlot | None:
        """A free slot for ``nbytes``, waiting for one; None if they do not fit a slot.

        Args:
            nbytes: the chunk's bytes in the slot.
            keep_one: wait while fewer than two slots are free (the training thread).
        """
        if not self.fits(nbytes):
            self.oversize += 1
            return None
        if self._buffer is None:
            self.allocate()
        need = 2 if keep_one else 1
        with self._cond:
            if len(self._free) < need:
                started = time.perf_counter()
                self.waits += 1
                self._cond.wait_for(lambda: len(self._free) >= need)
                self.wait_seconds += time.perf_counter() - started
            return PinnedSlot(self, self._free.pop())

    def copy_in(self, *tensors: torch.Tensor) -> tuple[PinnedSlot, list[torch.Tensor]] | None:
        """Copy host ``tensors`` into a free slot (waiting for one); None if they fit none.

        The dump worker's side (it may take the last free slot).
        """
        slot = self.take(_slot_bytes(*tensors), keep_one=False)
        if slot is None:
            return None
        copies = slot.carve(tensors)
        for src, dst in zip(tensors, copies, strict=True):
            dst.copy_(src)
        return slot, copies

    def _give(self, buffer: torch.Tensor) -> None:
        with self._cond:
            self._free.append(buffer)
            self._cond.notify_all()

    def free_slots(self) -> int:
        """Slots free now."""
        with self._cond:
            return len(self._free)


COPY_PIECE_BYTES = 4 << 20
"""The dump worker copies rows to host memory in pieces of at most this many bytes."""

COPY_QUEUED_PIECES = 0
"""At most this many of the dump worker's pieces are queued on the copy engine at once; 0 (the
default) queues each chunk's copy whole. Off until a training loop's step times show it pays
(``bench/bench_train_loop_gpu.py --copy-queued 2``).

A device's copies to host memory run one after another, whatever stream queued them: a scalar
the training reads (``loss.item()``) waited behind every byte queued before it, 9.6 ms behind
512 MB on an H200 (pieces of 2-32 MB queued at once made no difference). Two pieces of 4 MB
are about 0.15 ms of copying there; with two queued the engine never idles between them."""


class _CopyEngine:
    """One copy stream per device; host memory from a :class:`PinnedRing` or torch's pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self._queued: deque[torch.cuda.Event] = deque()
        self._spare: list[torch.cuda.Event] = []
        self._pacing = threading.Lock()

    def _paced_copy(self, host: torch.Tensor, t: torch.Tensor) -> None:
        """``host.copy_(t)`` on the copy stream in row pieces, few queued at a time."""
        with self._pacing:
            self._paced_pieces(host, t)

    def _paced_pieces(self, host: torch.Tensor, t: torch.Tensor) -> None:
        assert self.stream is not None
        rows = int(t.shape[0]) if t.dim() else 1
        row_bytes = max(1, t.nbytes // max(1, rows))
        step = rows if t.dim() == 0 else max(1, COPY_PIECE_BYTES // row_bytes)
        for start in range(0, rows, step):
            while len(self._queued) >= COPY_QUEUED_PIECES:
                done = self._queued.popleft()
                done.synchronize()  # the GIL is free meanwhile
                self._spare.append(done)
            if t.dim():
                host[start : start + step].copy_(t[start : start + step], non_blocking=True)
            else:
                host.copy_(t, non_blocking=True)
            event = self._spare.pop() if self._spare else torch.cuda.Event()
            event.record(self.stream)
            self._queued.append(event)

    def to_host(
        self,
        *tensors: torch.Tensor,
        wait_current: bool = True,
        ring: PinnedRing | None = None,
        keep_one: bool = False,
        paced: bool = False,
    ) -> tuple[list[torch.Tensor], torch.cuda.Event | None, PinnedSlot | None]:
        """Copy device tensors into pinned host tensors asynchronously.

        With ``wait_current`` the copy stream first waits for the calling thread's current
        stream (the producer of ``tensors``). With ``ring`` the host tensors lie in one of its
        slots (returned; ``keep_one`` as :meth:`PinnedRing.take`), else in fresh pinned
        tensors of torch's caching host allocator. ``paced`` (the dump worker's copies): in
        pieces, never more than :data:`COPY_QUEUED_PIECES` queued (the call waits for the
        earlier ones), so that the training's own device-to-host reads never queue behind a
        dump's rows.
        """
        if not self.cuda:
            return list(tensors), None, None
        assert self.stream is not None
        slot = ring.take(_slot_bytes(*tensors), keep_one) if ring is not None else None
        if wait_current:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        if slot is not None:
            hosts = slot.carve(tensors)
        else:
            hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        with torch.cuda.stream(self.stream):
            for t, host in zip(tensors, hosts, strict=True):
                if paced and COPY_QUEUED_PIECES > 0:
                    self._paced_copy(host, t)
                else:
                    host.copy_(t, non_blocking=True)
                t.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
        return hosts, event, slot


_ENGINES: dict[torch.device, _CopyEngine] = {}


def _engine(device: torch.device) -> _CopyEngine:
    eng = _ENGINES.get(device)
    if eng is None:
        eng = _ENGINES[device] = _CopyEngine(device)
    return eng


def warm_up_gather(weight: torch.Tensor, ids: torch.Tensor) -> None:
    """Do once what a dump's first gather of ``weight`` would (copy stream, kernels), untimed.

    Called before training: on the training thread at the first dump the copy stream's
    creation alone took 4 ms on an H200 host.
    """
    _engine(weight.device)
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
    eng = _engine(rows.device)
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
        :func:`~deltarec.tracking.staging.device_staging` block with room on a CUDA device: one
        :class:`DeviceRows` with every row instead.
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if weight.requires_grad:  # a live nn.Parameter: read its values, record no autograd graph
        weight = weight.detach()
    n = int(ids.shape[0])
    eng = _engine(weight.device)
    budget, ring = current_budget(), current_ring()
    if eng.cuda and budget is not None and n > 0:
        staged = stage_on_device(weight, ids, budget, key_offset, keys)
        if staged is not None:
            yield staged
            return
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
) -> DeviceRows | None:
    """Gather ``weight[ids]`` into one device staging buffer if ``budget`` has room.

    Returns None (nothing taken) when the rows do not fit the budget or the device has no
    memory left for them; the caller then gathers into host memory as before.
    """
    if weight.requires_grad:
        weight = weight.detach()
    n = int(ids.shape[0])
    nbytes = n * (int(weight.shape[1]) * weight.element_size() + 8)
    device = weight.device
    if not budget.try_take(device, nbytes, f"a table of {n} rows"):
        return None
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
    ops = _NO_OPS.expand(n)
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
"""A staged table's ops, expanded to its length (a host tensor: staging writes none)."""
