"""What the server and the CPUs did while a trial of ``bench_readers.py`` published.

Where a reader's worst reads come from: Redis's own latency monitor (``LATENCY``: commands
and scripts slower than the threshold, writes of the append-only file, forks), its slowlog,
``INFO`` counters before and after, and the time each process's threads spent ready to run but
waiting for a CPU (``/proc/<pid>/task/<tid>/schedstat``, the run-queue delay), for the
server's threads and the reader process's.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from typing import Any

LATENCY_MS = 1
"""Redis's latency monitor threshold: every event of at least this many ms is kept."""

_INFO = (
    "total_commands_processed", "total_net_input_bytes", "aof_current_size", "aof_delayed_fsync",
    "total_forks", "used_memory", "used_memory_rss", "mem_fragmentation_ratio",
    "allocator_frag_ratio", "lazyfreed_objects", "instantaneous_ops_per_sec",
)  # fmt: skip


def process_tree(pid: int) -> set[int]:
    """``pid`` and its descendants (a PostgreSQL server: the postmaster and its backends)."""
    tree, parents = {pid}, {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{name}/stat") as f:
                parents[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
    grew = True
    while grew:
        more = {p for p, pp in parents.items() if pp in tree} - tree
        tree |= more
        grew = bool(more)
    return tree


def run_queue_ns(pid: int) -> dict[int, tuple[int, int]]:
    """Per thread of ``pid`` and its descendants: (on-CPU, waiting-for-a-CPU) ns so far."""
    out: dict[int, tuple[int, int]] = {}
    for p in process_tree(pid):
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{p}/task/{tid}/schedstat") as f:
                    cpu, wait, _ = (int(x) for x in f.read().split())
                    out[int(tid)] = (cpu, wait)
    return out


def _delta(now: dict[int, tuple[int, int]], then: dict[int, tuple[int, int]]) -> tuple[int, int]:
    """Summed over the threads alive now (a thread started since counts from zero)."""
    cpu = sum(c - then.get(t, (0, 0))[0] for t, (c, _) in now.items())
    wait = sum(w - then.get(t, (0, 0))[1] for t, (_, w) in now.items())
    return cpu, wait


def cpu_list(text: str) -> set[int]:
    """``"0-3,8"`` -> {0, 1, 2, 3, 8}."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def parse_pin(text: str | None) -> dict[str, list[int]]:
    """``--pin readers=0-3,server=4-7,publisher=8-15`` -> {role: CPUs} (any subset of roles)."""
    if not text:
        return {}
    pin: dict[str, list[int]] = {}
    for item in text.replace(";", " ").split():
        for role_cpus in re.split(r",(?=[a-z])", item):
            role, sep, cpus = role_cpus.partition("=")
            if not sep or role not in ("readers", "server", "publisher"):
                raise SystemExit(f"--pin: {role_cpus!r} is not readers|server|publisher=CPUS")
            pin[role] = sorted(cpu_list(cpus))
    return pin


def pin_process_tree(pid: int, cpus: list[int]) -> int:
    """Every thread of ``pid`` and of its descendants on ``cpus``; how many threads were pinned.

    A server's later children (a PostgreSQL backend per connection) inherit the affinity.
    """
    n = 0
    for p in process_tree(pid):
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), cpus)
                    n += 1
    return n


Queues = dict[str, tuple[int, dict[int, tuple[int, int]]]]
"""Per role (``server``, ``readers``): its pid and :func:`run_queue_ns` of it."""


def queues_now(pids: dict[str, int | None]) -> Queues:
    """:func:`run_queue_ns` of each role's process (those with a pid)."""
    return {k: (p, run_queue_ns(p)) for k, p in pids.items() if p}


def queues_since(then: Queues, elapsed: float) -> dict[str, dict[str, float]]:
    """Each role's CPU seconds and seconds ready but waiting for a CPU since ``then``."""
    out = {}
    for k, (pid, before) in then.items():
        now = run_queue_ns(pid)
        cpu, wait = _delta(now, before)
        out[k] = {
            "cpu_s": round(cpu / 1e9, 3),
            "wait_s": round(wait / 1e9, 3),
            "threads": len(now),
            "of_s": round(elapsed, 3),
        }
    return out


class ServerWatch:
    """Snapshots before a publish, the differences after it (see the module doc).

    Args:
        kind: the store kind; only Redis has a latency monitor, every kind gets the run queue.
        port: Redis's port.
        server_pid: the server's process (its threads), or None.
        reader_pid: the reader process, or None.
    """

    def __init__(
        self, kind: str, port: int | None, server_pid: int | None, reader_pid: int | None
    ) -> None:
        self.kind, self.port = kind, port
        self.pids = {"server": server_pid, "readers": reader_pid}
        self._client: Any = None
        if kind == "redis" and port is not None:
            import redis

            self._client = redis.Redis(host="127.0.0.1", port=port)
        self._start: dict[str, Any] = {}

    def start(self) -> None:
        """Reset the latency monitor; note the slowlog's newest entry; snapshot the counters."""
        c = self._client
        if c is not None:
            c.config_set("latency-monitor-threshold", LATENCY_MS)
            c.config_set("slowlog-log-slower-than", LATENCY_MS * 1000)
            c.config_set("slowlog-max-len", 1000)
            c.execute_command("LATENCY", "RESET")
            # the slowlog's newest entry, not a reset: freeing 1000 entries stalls the server
            newest = c.slowlog_get(1)
            self._start["slow_id"] = int(newest[0]["id"]) if newest else -1
            self._start["info"] = self._info()
        self._start["t"] = time.time()
        self._start["rq"] = queues_now(self.pids)

    def _info(self) -> dict[str, float]:
        info: Any = self._client.info("all")
        return {k: float(info[k]) for k in _INFO if k in info}

    def stop(self) -> dict[str, Any]:
        """What happened since :meth:`start`: events, slow commands, counters, run queues."""
        out: dict[str, Any] = {}
        elapsed = time.time() - self._start["t"]
        out["run_queue"] = queues_since(self._start["rq"], elapsed)
        c = self._client
        if c is None:
            return out
        latest = c.execute_command("LATENCY", "LATEST")
        out["latency_latest"] = {  # event, when last, the last's ms, the most ms
            _s(e[0]): {"max_ms": int(e[3]), "last_ms": int(e[2])} for e in latest
        }
        out["latency_history"] = {
            _s(e[0]): [
                (round(int(ts) - self._start["t"], 0), int(ms))
                for ts, ms in c.execute_command("LATENCY", "HISTORY", e[0])
            ]
            for e in latest
        }
        # only the entries since start: the whole log (1000 entries, up to 32 arguments each,
        # some left by the trial before) is a reply of milliseconds, every reader waiting
        newest = c.slowlog_get(1)
        new = int(newest[0]["id"]) - self._start["slow_id"] if newest else 0
        slow = [
            s for s in (c.slowlog_get(min(1000, new)) if new > 0 else [])
            if int(s["id"]) > self._start["slow_id"]
        ]  # fmt: skip
        out["slowlog_n"] = len(slow)
        out["slowlog_top"] = [
            {
                "at_s": round(int(s["start_time"]) - self._start["t"], 0),
                "ms": round(int(s["duration"]) / 1e3, 2),
                "cmd": _s(s["command"])[:60],
            }
            for s in sorted(slow, key=lambda s: -int(s["duration"]))[:8]
        ]
        after, before = self._info(), self._start["info"]
        out["info"] = {
            k: (round(after[k] - before.get(k, 0), 3) if k.startswith(("total_", "aof_")) else
                after[k])
            for k in after
        }  # fmt: skip
        return out


def move_aof(port: int, where: str) -> str:
    """Redis's append-only file: as the fixture keeps it, off, on tmpfs, or never fsynced.

    ``disk``: unchanged; ``off``: ``appendonly no``; ``nofsync``: on the disk, ``appendfsync
    no`` (the kernel writes it back when it will).

    ``shm``: the server's folder becomes a new one under ``/dev/shm`` and the file is rewritten
    there (``BGREWRITEAOF`` of the still empty data set), so every later write of the file goes to
    memory instead of the disk: whether the disk's writes are what stalls the server.
    """
    import redis

    c = redis.Redis(host="127.0.0.1", port=port)
    if where == "off":
        c.config_set("appendonly", "no")
    elif where == "nofsync":  # on the disk, written but never fsynced by the server
        c.config_set("appendfsync", "no")
    elif where == "shm":
        import tempfile

        c.config_set("dir", tempfile.mkdtemp(prefix="deltarec-redis-aof-", dir="/dev/shm"))
        c.bgrewriteaof()
        deadline = time.time() + 30
        while c.info("persistence")["aof_rewrite_in_progress"] and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # the rewrite's file is swapped in by the server's next cron
    return str(c.config_get("dir")["dir"])


def _s(x: Any) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else str(x)


def describe(diag: dict[str, Any]) -> str:
    """One line: run-queue waits, the latency events' maxima, the slowest commands."""
    parts = []
    for k, v in diag.get("run_queue", {}).items():
        parts.append(f"{k} cpu {v['cpu_s']} s wait-for-cpu {v['wait_s']} s")
    for k, v in diag.get("run_queue_before", {}).items():
        parts.append(f"(before the publish {v['of_s']:.1f} s: {k} {v['cpu_s']} / {v['wait_s']} s)")
    for event, v in diag.get("latency_latest", {}).items():
        n = len(diag["latency_history"].get(event, []))
        parts.append(f"LATENCY {event} max {v['max_ms']} ms ({n} s with one)")
    if "slowlog_n" in diag:
        top = ", ".join(f"{s['ms']} ms @{s['at_s']:g}s" for s in diag["slowlog_top"][:4])
        parts.append(f"slowlog {diag['slowlog_n']} >= {LATENCY_MS} ms: {top}")
    return "; ".join(parts)
