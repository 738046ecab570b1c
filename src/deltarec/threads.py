"""Daemon threads kept between short jobs, instead of a new thread for each.

A publish reads every part of a dump on a helper thread (:mod:`deltarec.readahead`) and checks
its shards' sha256 on another; a thread started for each part and ended after it makes glibc
hand its allocator arenas from thread to thread, and the process's resident memory grows by
tens of MB over a long publish. :func:`start` runs a job on an idle kept thread, or on a new
one that then stays for the next job. A thread idle for :data:`IDLE_S` ends.

A thread starts with the scheduling priority of the thread that starts it, and a publish
under a read budget lowers its own (:mod:`deltarec.publish.yieldcpu`): each kept thread is
known by its priority, and a job goes to an idle thread of the caller's priority only (or to a
new one, started by the caller), so a job of a lowered publisher never raises its priority
and a job of anyone else (the dumper's checksums) never runs lowered.

The threads are daemons: a job still running when the interpreter exits is dropped, as a daemon
thread's would be. The standard library only: every layer may use it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

IDLE_S = 10.0
"""A kept thread with no job for this long ends."""

IDLE_NAME = "deltarec-kept"
"""The name of a kept thread between jobs (it takes each job's name while it runs it)."""


class Job:
    """A function running on a kept thread. :meth:`join` waits for it to return."""

    def __init__(self, fn: Callable[[], object], name: str) -> None:
        self.fn = fn
        self.name = name
        self.thread: threading.Thread | None = None
        self._done = threading.Event()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the job has returned (at most ``timeout`` s); whether it has."""
        return self._done.wait(timeout)

    def done(self) -> bool:
        """Whether the job has returned."""
        return self._done.is_set()

    def on_this_thread(self) -> bool:
        """Whether the caller is the job itself (a job must not join itself)."""
        return self.thread is threading.current_thread()


def _priority() -> tuple[int, int] | None:
    """The calling thread's scheduling policy and nice value (None: not known here)."""
    if not hasattr(os, "sched_getscheduler"):
        return None
    try:
        return os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)
    except OSError:
        return None


class _Kept:
    """One kept thread: runs the jobs handed to it, one at a time.

    ``priority``: the thread's own (that of the thread that started it, until a job changes it).
    """

    def __init__(self, priority: tuple[int, int] | None) -> None:
        self.priority = priority
        self.jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=IDLE_NAME, daemon=True)

    def _loop(self) -> None:
        me = threading.current_thread()
        while True:
            try:
                job = self.jobs.get(timeout=IDLE_S)
            except queue.Empty:
                with _lock:
                    if self in _idle:  # nobody is handing it a job: end
                        _idle.remove(self)
                        return
                continue  # taken off the idle list just now: its job is on the way
            job.thread = me
            me.name = job.name
            try:
                job.fn()
            except BaseException:  # a job handles its own errors; never lose the thread
                log.exception("a job on thread %r raised", job.name)
            finally:
                me.name = IDLE_NAME
                job.thread = None
                self.priority = _priority()  # a job may have changed it
                with _lock:
                    _idle.append(self)
                job._done.set()


_lock = threading.Lock()
_idle: list[_Kept] = []


def start(fn: Callable[[], object], name: str) -> Job:
    """Run ``fn`` on a kept daemon thread named ``name`` while it runs; returns its job.

    The thread has the caller's scheduling priority (see the module doc).
    """
    job = Job(fn, name)
    mine = _priority()
    with _lock:
        kept = next((k for k in reversed(_idle) if k.priority == mine), None)
        if kept is not None:
            _idle.remove(kept)
    if kept is None:
        kept = _Kept(mine)
        kept.jobs.put(job)
        kept.thread.start()
    else:
        kept.jobs.put(job)
    return job


def _forget_after_fork() -> None:
    """A forked child has none of its parent's threads: forget them."""
    global _lock
    _lock = threading.Lock()
    _idle.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
