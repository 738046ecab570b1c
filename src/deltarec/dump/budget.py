"""Budgets of the dump path: host staging memory and encoding threads (defaults, sharing).

The device staging budget lives with the gather, in :mod:`deltarec.tracking.device_budget`. The
standard library only, so the configuration imports these defaults cheaply.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MIN_HOST_BUDGET = 64 << 20
"""The host budget never defaults below this (the budget before it was sized from memory)."""
HOST_BUDGET_SHARE = 8
"""By default a rank's host budget is 1/8 of the available memory, split among local ranks."""
MAX_DEFAULT_HOST_BUDGET = 16 << 30
"""The default host budget stops growing here (a dump gains little from more)."""


def available_memory() -> int:
    """Bytes of host memory available to new allocations (``MemAvailable``), or 0 if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return 0


def local_world_size() -> int:
    """Training processes on this host (``LOCAL_WORLD_SIZE`` as torchrun sets it; else 1)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def default_host_budget() -> int:
    """This rank's share of host memory for gathered and encoded rows (bytes).

    ``MemAvailable / 8 / LOCAL_WORLD_SIZE``, at least 64 MiB and at most 16 GiB.
    """
    share = available_memory() // HOST_BUDGET_SHARE // local_world_size()
    return int(min(max(share, MIN_HOST_BUDGET), MAX_DEFAULT_HOST_BUDGET))


def usable_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_encode_workers() -> int:
    """Encoding threads per rank: the cores the training processes leave free, split evenly.

    ``(cores - LOCAL_WORLD_SIZE) // LOCAL_WORLD_SIZE``, at least 1: with as many ranks as
    cores (the 2-core development machine), one thread encodes, as before.
    """
    ranks = local_world_size()
    return max(1, (usable_cores() - ranks) // ranks)


ARENA_SHARE = 8
"""The encoders' reusable piece buffers take at most 1/8 of the host budget ..."""
ARENA_MAX = 128 << 20
"""... and at most 128 MiB."""
HAND_OFF_SHARE = 8
"""A publishing trainer's rows handed to its background publisher from memory take at most
1/8 of the host budget: a dump's kept rows up to 1/4 of that (twice that while they are
joined at the commit), the publisher's queue the other half. A larger dump is handed over
without rows (the publisher reads its shards back)."""
SCRATCH_SHARE = 4
"""The encodings running at once take at most 1/4 of the host budget as scratch; a budget too
small for one scratch per encoding thread runs fewer threads (one at least)."""
PINNED_SHARE = 4
"""CUDA tables: the pinned ring that chunks are copied into takes at most 1/4 of the host
budget (:class:`~deltarec.tracking.pinned.PinnedRing`), as a power of two of bytes (torch's
pinned allocator rounds every allocation up to one), enough for two chunks per encoding thread
and four more; a budget that affords fewer than two slots gets no ring (chunks are then pinned
one by one)."""


@dataclass(frozen=True)
class HostBudgetPlan:
    """How a rank's host budget is shared out (see :func:`plan_host_budget`).

    Attributes:
        queue_bytes: for rows gathered or copied from the device and their encoded pieces,
            until written and hashed (the byte-bounded queue's capacity).
        encode_threads: encoding threads.
        scratch_bytes: the scratch of ``encode_threads`` encodings running at once.
        arena_bytes: the encoders' reusable piece buffers, at most.
        keep_rows_bytes: a dump's rows kept in memory for the publisher, at most (0: none).
        publish_queue_bytes: kept rows waiting in the background publisher's queue, at most.
        pinned_slots: slots of the pinned ring (0: no ring); ``pinned_bytes``: its bytes.
    """

    queue_bytes: int
    encode_threads: int
    scratch_bytes: int
    arena_bytes: int
    keep_rows_bytes: int = 0
    publish_queue_bytes: int = 0
    pinned_slots: int = 0
    pinned_bytes: int = 0


def plan_host_budget(
    budget: int,
    encode_threads: int,
    scratch_per_encoding: int,
    hand_off: bool = False,
    pinned_slot_bytes: int = 0,
) -> HostBudgetPlan:
    """Share a host budget out: the queue, the scratch, the piece arena, the hand-off, the ring.

    Every byte the dump path holds in host memory comes out of ``budget``: rows and their
    pieces through the queue, at most ``encode_threads`` encodings of ``scratch_per_encoding``
    bytes each (:func:`~deltarec.dump.encode.encode_scratch_bytes` of the widest table's
    chunk), the piece arena, and with ``hand_off`` (a publishing trainer) the rows kept for
    its background publisher (:data:`HAND_OFF_SHARE`), and with ``pinned_slot_bytes`` (one
    chunk's bytes, CUDA tables) the pinned ring (:data:`PINNED_SHARE`). Threads are cut to
    what 1/4 of the budget affords.
    """
    hand = budget // HAND_OFF_SHARE if hand_off else 0
    arena = min(ARENA_MAX, budget // ARENA_SHARE)
    threads = max(1, encode_threads)
    if scratch_per_encoding > 0:
        threads = max(1, min(threads, budget // SCRATCH_SHARE // scratch_per_encoding))
    scratch = threads * max(0, scratch_per_encoding)
    slots = ring = 0
    if pinned_slot_bytes > 0:
        want = min((2 * threads + 4) * pinned_slot_bytes, budget // PINNED_SHARE)
        ring = 1 << (want.bit_length() - 1) if want > 0 else 0  # a power of two, <= want
        slots = ring // pinned_slot_bytes
        if slots < 2:
            slots = ring = 0
    return HostBudgetPlan(
        queue_bytes=max(1, budget - arena - scratch - hand - ring),
        encode_threads=threads,
        scratch_bytes=scratch,
        arena_bytes=arena,
        keep_rows_bytes=hand // 4,
        publish_queue_bytes=hand // 2,
        pinned_slots=slots,
        pinned_bytes=ring,
    )
