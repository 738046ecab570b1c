"""Changes to this process's environment: ones that undo themselves, and numpy's thread pool.

numpy's OpenBLAS starts a thread per core when numpy is imported, and each spins for about
0.1 s before it sleeps (measured on 2 cores: 0.1 s of CPU for its one extra thread; on a host
of 16 cores that is 15 threads busy at once). deltarec does no linear algebra in numpy, so
where a process of its own starts beside a store's server and its readers (a ``deltarec``
command, the read-latency probe) that burst only takes cores from the readers waking in it
(the likely cause of reads of 4-7 ms against an idle p99 of 0.5 ms, all clients at once, in
the first 0.1-0.2 s of ``deltarec publish`` on a 16-core host; bench/results/readers.md
run 17):
:data:`ONE_BLAS_THREAD` keeps that pool to one thread, unless the variable is set already.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator

__all__ = [
    "ONE_BLAS_THREAD",
    "call_with_one_blas_thread",
    "environ_set",
    "one_blas_thread",
]

ONE_BLAS_THREAD = ("OPENBLAS_NUM_THREADS", "1")
"""numpy's OpenBLAS with one thread (see the module doc)."""


@contextlib.contextmanager
def environ_set(name: str, value: str) -> Iterator[None]:
    """Set the environment variable ``name`` to ``value`` while inside.

    On the way out the variable gets back the value it had, or is removed again if it was
    unset, so the processes started after the block see what they would have seen before.
    """
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def one_blas_thread() -> bool:
    """Keep numpy's OpenBLAS to one thread in this process, if numpy is not imported yet.

    The variable is set (unless set already) for this process and the ones it starts; once
    numpy is imported its pool exists and nothing changes. Whether it was set now.
    """
    name, value = ONE_BLAS_THREAD
    if "numpy" in sys.modules or name in os.environ:
        return False
    os.environ[name] = value
    return True


def call_with_one_blas_thread(module: str, function: str, *args: object) -> object:
    """``module.function(*args)``, numpy's OpenBLAS kept to one thread first.

    The entry of a child process (``multiprocessing``'s spawn) whose own imports bring numpy
    in: the variable is set in the child, before those imports, so no other process's
    environment changes and no thread of the parent (a trainer's) races with a change of its
    own. ``args`` must not import numpy when unpickled (plain values, shared ctypes): they
    are unpickled before this runs. Nor must the parent's main module, which spawn imports
    again in the child first: a training script that imports numpy at its top keeps the
    pool in the child as well.
    """
    one_blas_thread()
    return getattr(importlib.import_module(module), function)(*args)
