"""Budgets of the dump path: host staging memory and encoding threads (defaults).

The device staging budget lives with the gather, in :mod:`deltarec.tracking.staging`. The
standard library only, so the configuration imports these defaults cheaply.
"""

from __future__ import annotations

import os

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
