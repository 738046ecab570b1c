"""Pinned host memory for a dump's device→host copies, and the copy engine that fills it.

A :class:`PinnedRing` is allocated once, when the dumper starts, and reused: a chunk's slot is
given back once its bytes are written. Pinned memory is never allocated while training runs:
``cudaHostAlloc`` holds the GIL and the CUDA driver's lock for 17-56 ms per 32 MiB chunk on an
H200 host, which stalled the training thread's kernel launches for as long.

One :class:`CopyEngine` per device owns the copy stream that every device→host copy of the
dumps runs on (:func:`copy_engine`); outside a ring, chunks are pinned one by one through torch's
caching host allocator. Used by :mod:`deltarec.tracking.gather`.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)


_ALIGN = 64


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def slot_bytes(*tensors: torch.Tensor) -> int:
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
        """Whether a chunk of ``nbytes`` (:func:`slot_bytes`) fits one slot."""
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
        slot = self.take(slot_bytes(*tensors), keep_one=False)
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


class CopyEngine:
    """One copy stream per device (:func:`copy_engine`), filling a ring or torch's pinned pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None

    def to_host(
        self,
        *tensors: torch.Tensor,
        wait_current: bool = True,
        ring: PinnedRing | None = None,
        keep_one: bool = False,
    ) -> tuple[list[torch.Tensor], torch.cuda.Event | None, PinnedSlot | None]:
        """Copy device tensors into pinned host tensors asynchronously.

        With ``wait_current`` the copy stream first waits for the calling thread's current
        stream (the producer of ``tensors``). With ``ring`` the host tensors lie in one of its
        slots (returned; ``keep_one`` as :meth:`PinnedRing.take`), else in fresh pinned
        tensors of torch's caching host allocator.
        """
        if not self.cuda:
            return list(tensors), None, None
        assert self.stream is not None
        slot = ring.take(slot_bytes(*tensors), keep_one) if ring is not None else None
        if wait_current:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        if slot is not None:
            hosts = slot.carve(tensors)
        else:
            hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        with torch.cuda.stream(self.stream):
            for t, host in zip(tensors, hosts, strict=True):
                host.copy_(t, non_blocking=True)
                t.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
        return hosts, event, slot


_ENGINES: dict[torch.device, CopyEngine] = {}


def copy_engine(device: torch.device) -> CopyEngine:
    """The copy engine of ``device`` (made at the first call, then kept)."""
    eng = _ENGINES.get(device)
    if eng is None:
        eng = _ENGINES[device] = CopyEngine(device)
    return eng
