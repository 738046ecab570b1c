"""The publisher's threads yield the CPU to serving while a read-latency budget is set.

On a machine whose cores the publisher shares with the store's server and its readers, a
read often waits for a core rather than for the store: the publisher decodes, checks and
encodes rows for as long as the scheduler lets it, and the reader or the server woken by a
request waits for the end of a time slice (milliseconds). Under a budget
(:mod:`deltarec.publish.budget`) the thread that publishes lowers its own scheduling priority
(:func:`lower`): Linux's ``SCHED_IDLE`` policy, under which any thread of normal priority that
wakes up takes the core at once. The threads it starts afterwards inherit it (the store's
sender, the read-ahead and checksum threads; :mod:`deltarec.threads` keeps threads of a lowered
priority apart from the others, so a job of normal priority never lands on one). No other
thread of the process changes: not the trainer's training thread, not a thread started before.

The probe process that times the readers' latency must not inherit it (it would time its own
wait for a core): the budget starts it before the publishing thread lowers.

Lowering is always allowed on Linux; raising back is not without ``CAP_SYS_NICE`` (or a
``RLIMIT_NICE`` that allows it): :func:`restore` tries and otherwise leaves the thread lowered
(the publish CLI exits, the trainer's publisher thread is its own). Where the system has no
such call (not Linux) or refuses it, the publisher logs it once and goes on at its priority.

The trainer's background compaction (:mod:`deltarec.dump.compactor`) lowers its child process
the same way, before the child starts any thread, and puts its disk I/O in the idle class
(:func:`lower_io`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading
from dataclasses import dataclass
from typing import TypeVar

log = logging.getLogger(__name__)

_T = TypeVar("_T")

_warned = False


@dataclass(frozen=True)
class Priority:
    """A thread's scheduling policy (``os.SCHED_*``) and nice value."""

    policy: int
    nice: int


def _supported() -> bool:
    return hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE")


def thread_priority(tid: int | None = None) -> Priority | None:
    """The policy and nice value of thread ``tid`` (native id; None: the calling thread).

    None where the system cannot tell (not Linux, or no such thread).
    """
    if not _supported():
        return None
    tid = threading.get_native_id() if tid is None else tid
    try:
        return Priority(os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid))
    except OSError:
        return None


def _warn_once(what: str, error: OSError | None, who: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        why = "not supported here" if error is None else str(error)
        log.warning("%s cannot %s (%s); it runs as it is", who, what, why)


def lower(who: str = "read budget: the publisher") -> Priority | None:
    """Put the calling thread under ``SCHED_IDLE``; the priority it had, or None if it could not.

    A thread already there is left alone (and its priority returned). ``who``: the subject of
    the one warning logged where the system cannot or will not.
    """
    former = thread_priority()
    if former is None:
        _warn_once("lower its CPU priority", None, who)
        return None
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
    except OSError as e:
        _warn_once("lower its CPU priority", e, who)
        return None
    return former


_IOPRIO_CALLS = {"x86_64": (251, 252), "aarch64": (30, 31), "riscv64": (30, 31)}
"""``(ioprio_set, ioprio_get)`` system call numbers by machine (Linux)."""
_IOPRIO_WHO_PROCESS, _IOPRIO_CLASS_SHIFT = 1, 13
IOPRIO_CLASS_IDLE = 3


def _ioprio(call: int, *args: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.syscall(call, _IOPRIO_WHO_PROCESS, 0, *args))


def lower_io() -> bool:
    """Put the calling thread's disk I/O in the idle class; whether the system allowed it.

    ``ioprio_set(IOPRIO_CLASS_IDLE)``: an I/O scheduler that knows classes (BFQ, mq-deadline)
    serves the thread's requests after everyone else's; ``none`` ignores the class. Threads and
    processes the thread starts afterwards inherit it. Unprivileged and one-way, like
    :func:`lower`. False, nothing changed, where there is no such call (not Linux).
    """
    calls = _IOPRIO_CALLS.get(platform.machine())
    if not calls or not hasattr(os, "sched_setscheduler"):
        return False
    return _ioprio(calls[0], IOPRIO_CLASS_IDLE << _IOPRIO_CLASS_SHIFT) == 0


def io_priority_class() -> int | None:
    """The calling thread's I/O priority class (``ioprio_get``), None where it cannot tell."""
    calls = _IOPRIO_CALLS.get(platform.machine())
    if not calls or not hasattr(os, "sched_setscheduler"):
        return None
    value = _ioprio(calls[1])
    return None if value < 0 else value >> _IOPRIO_CLASS_SHIFT


def restore(tid: int, former: Priority) -> bool:
    """Give thread ``tid`` its ``former`` priority back; whether the system allowed it.

    Unprivileged, Linux refuses (see the module doc): the thread stays lowered. A thread that
    has ended is not an error.
    """
    try:
        os.sched_setscheduler(tid, former.policy, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, tid, former.nice)
    except ProcessLookupError:
        return True
    except OSError as e:
        log.debug("read budget: thread %d keeps its lowered priority (%s)", tid, e)
        return False
    return True
