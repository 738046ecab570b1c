"""Probe reads of serving keys, timed the way a serving client sees them (a process of its own).

The read-latency budget (:mod:`deltarec.publish.budget`) needs to know what the publisher's
writes do to the readers. A reader thread inside the publisher would time its own waits for
the interpreter lock along with the store's, so the probe is a separate process with its own
connection: every ``interval_s`` it reads one serving key the way a serving client does (SQL:
``SELECT embedding, version FROM <serving name> WHERE key = ?``; Redis: ``HGET emb:<table> key``)
and appends when it started (``time.monotonic()``, one clock for every process of the machine)
and its latency to a shared ring the publisher reads (:meth:`Probe.take`): the publisher tells
the reads made while it wrote from those made while it did not.

The keys probed are sampled from the serving name itself, again every second (Redis:
``HRANDFIELD`` of :data:`REDIS_KEYS`; SQL: a run of :data:`KEYS` keys from a random place in the
key range), so the probe reads rows that exist, spread over the table, as serving does.

The process can be started before the name is known (:func:`probe_target` without a table) and
aimed later (:meth:`Probe.aim`): its start (a new interpreter, its imports and connection,
~0.4 s on 2 cores) then overlaps the publisher's own start instead of holding the first write.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deltarec.environ import call_with_one_blas_thread
from deltarec.stores.base import Store
from deltarec.stores.naming import quote, view_name

RING = 4096
"""Reads the ring holds; the publisher reads them far more often than it fills."""
KEYS = 256
"""Keys sampled from a SQL serving name at a time (one range of the key index)."""
REDIS_KEYS = 16
"""Keys sampled from a Redis serving name at a time. ``HRANDFIELD`` picks each at random and
the server runs it alone, every reader waiting: 256 a second were the slowest commands of the
server's slowlog during budgeted publishes on 2 cores (5-11 ms; bench/results/readers.md run
20), the probe's own stall of the readers it is there to protect."""
RESAMPLE_S = 1.0
"""Seconds between two samples of keys (new rows land while the probe runs)."""
RESAMPLE = 2
"""The parent's request for a sample of keys now (in the child's ``empty`` flag)."""
NAME_BYTES = 1024
"""Room for a serving name given later (:meth:`Probe.aim`)."""


@dataclass(frozen=True)
class ProbeTarget:
    """Where and how a probe reads: what the child process needs to connect (picklable).

    Attributes:
        kind: ``sqlite``, ``postgres`` or ``redis``.
        connect: the connection's arguments (a path, psycopg's keywords, redis-py's keywords).
        name: the serving name (SQL: the quoted, schema-qualified view; Redis: the hash).
    """

    kind: str
    connect: dict[str, Any]
    name: str


def probe_target(store: Store, table: str | None) -> ProbeTarget | None:
    """How a serving client reads ``table`` of ``store``, or None where it cannot be probed.

    ``table`` None: where to connect, the name left empty (:meth:`Probe.aim` gives it). PAI
    FeatureStore and an in-memory SQLite store have no second reader to time.
    """
    config: Any = getattr(store, "config", None)
    if config is None:
        return None
    if store.kind == "sqlite" and config.path != ":memory:":
        name = "" if table is None else quote(view_name(table, config.prefix))
        return ProbeTarget("sqlite", {"path": config.path}, name)
    if store.kind == "postgres":
        params = store.connect_params()  # type: ignore[attr-defined]  # the store's own server
        params["application_name"] = "deltarec-probe"
        view = "" if table is None else quote(view_name(table, config.prefix))
        return ProbeTarget("postgres", params, view and f"{quote(config.schema_name)}.{view}")
    if store.kind == "redis":
        args = {"host": config.host, "port": config.port, "db": config.db}
        if config.username:
            args["username"] = config.username
        return ProbeTarget("redis", args, "" if table is None else f"{config.prefix}{table}")
    return None


Reader = tuple[Callable[[int], object], Callable[[], list[int]]]
"""One read of one key as a serving client makes it, and a sample of keys the name holds."""


def _reader(target: ProbeTarget) -> Reader:
    """How the probe reads ``target`` (its name set), and how it finds keys to read."""
    name = target.name
    if target.kind == "sqlite":
        import sqlite3

        conn = sqlite3.connect(target.connect["path"], timeout=30)
        sql = f"SELECT embedding, version FROM {name} WHERE key = ?"
        return lambda key: conn.execute(sql, (key,)).fetchall(), lambda: _sql_sample(
            lambda q, a: conn.execute(q.replace("%s", "?"), a).fetchall(), name
        )
    if target.kind == "postgres":
        import psycopg

        pg = psycopg.connect(autocommit=True, **target.connect)
        sql = f"SELECT embedding, version FROM {name} WHERE key = %s"
        return lambda key: pg.execute(sql, (key,), prepare=True).fetchall(), lambda: _sql_sample(
            lambda q, a: pg.execute(q, a).fetchall(), name
        )
    import redis

    from deltarec.stores.config import env_password

    client = redis.Redis(password=env_password("REDIS_PASSWORD"), **target.connect)

    def sample() -> list[int]:
        fields: Any = client.hrandfield(name, REDIS_KEYS) or []
        return [int(f) for f in fields]

    return lambda key: client.hget(name, str(key)), sample


def _sql_sample(query: Callable[[str, tuple[Any, ...]], list[Any]], name: str) -> list[int]:
    """Keys of a SQL serving name from a random place in its key range (an index range scan)."""
    low, high = query(f"SELECT min(key), max(key) FROM {name}", ())[0]
    if low is None:
        return []
    start = random.randint(int(low), int(high))
    rows = query(f"SELECT key FROM {name} WHERE key >= %s ORDER BY key LIMIT {KEYS}", (start,))
    return [int(r[0]) for r in rows]


def _probe_main(
    where: tuple[str, dict[str, Any], str],
    interval_s: float,
    ring: Any,
    count: Any,
    stop: Any,
    aimed: Any,
    empty: Any,
) -> None:
    """The child: read a key every ``interval_s`` and record each (start, latency), until ``stop``.

    ``where``: the :class:`ProbeTarget`'s fields (plain values: the child unpickles them
    before its numpy is set to one thread). The keys are sampled again every
    :data:`RESAMPLE_S` (none yet: nothing is timed), or at once when the parent writes
    :data:`RESAMPLE` into ``empty``, where the child leaves 1 after a sample that found no
    key and 0 otherwise. Until the name is given (``aimed``, when the target came without
    one) nothing is read.
    """
    kind, connect, name = where
    while not name and not stop.is_set():
        stop.wait(interval_s)
        name = aimed.value.decode()
    if stop.is_set():
        return
    read, sample = _reader(ProbeTarget(kind, connect, name))
    keys: list[int] = []
    sampled = -RESAMPLE_S
    n = 0
    while not stop.is_set():
        if time.monotonic() - sampled >= RESAMPLE_S or empty.value == RESAMPLE:
            with contextlib.suppress(Exception):  # not provisioned yet: try again later
                keys = sample() or keys
            sampled = time.monotonic()
            empty.value = 0 if keys else 1
        if keys:
            key = random.choice(keys)
            at = time.monotonic()
            t0 = time.perf_counter()
            with contextlib.suppress(Exception):  # a read that fails is timed as it took
                read(key)
            ring[2 * (n % RING) + 1] = time.perf_counter() - t0
            ring[2 * (n % RING)] = at
            n += 1
            count.value = n
        stop.wait(interval_s)


class Probe:
    """A probe process reading ``target`` every ``interval_s`` seconds (until :meth:`close`).

    Args:
        target: what to read (:func:`probe_target`).
        interval_s: seconds between two probe reads (each takes one key).
    """

    def __init__(self, target: ProbeTarget, interval_s: float = 0.005) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads
        self._ring = ctx.Array("d", 2 * RING, lock=False)  # (start, latency) pairs
        self._count = ctx.Value("q", 0, lock=False)
        self._stop = ctx.Event()
        self._aimed = ctx.Array("c", NAME_BYTES, lock=False)  # the name, when given later
        self._empty = ctx.Value("b", 0, lock=False)  # 1: the name held no key when sampled
        self._read = 0
        self._process = ctx.Process(
            target=call_with_one_blas_thread,  # no burst of numpy's threads as it starts
            args=(
                __name__,
                _probe_main.__name__,
                (target.kind, target.connect, target.name),
                interval_s,
                self._ring,
                self._count,
                self._stop,
                self._aimed,
                self._empty,
            ),
            name="deltarec-probe",
            daemon=True,
        )
        self._process.start()

    def aim(self, name: str) -> None:
        """Give the serving name to read, where the target came without one (once).

        Raises:
            ValueError: the name is longer than :data:`NAME_BYTES` bytes.
        """
        raw = name.encode()
        if not raw or len(raw) >= NAME_BYTES:
            raise ValueError(f"probe: a serving name of 1 to {NAME_BYTES - 1} bytes, got {name!r}")
        self._aimed.value = raw

    def resample(self) -> None:
        """Have the child sample the name's keys now (rows were written where none were)."""
        self._empty.value = RESAMPLE

    def wait_first(self, timeout_s: float, count: int = 1, if_empty: bool = False) -> bool:
        """Wait until ``count`` probe reads are timed (or ``timeout_s``); whether they were.

        Unless ``if_empty``, gives up at once if the name held no key when last sampled
        (nothing to read yet).
        """
        deadline = time.monotonic() + timeout_s
        while self._count.value < count and self._process.is_alive():
            empty = self._empty.value == 1 and not self._count.value and not if_empty
            if time.monotonic() > deadline or empty:
                return False
            time.sleep(0.01)
        return self._count.value >= count

    def take(self) -> list[tuple[float, float]]:
        """The reads recorded since the last call, oldest first.

        Each is (``time.monotonic()`` at its start, its latency in seconds).
        """
        n = self._count.value
        start = max(self._read, n - RING)
        self._read = n
        ring = self._ring
        return [(ring[2 * (i % RING)], ring[2 * (i % RING) + 1]) for i in range(start, n)]

    def alive(self) -> bool:
        """Whether the probe process still runs (it ends if it cannot connect)."""
        return self._process.is_alive()

    def close(self) -> None:
        """Stop the probe process (idempotent)."""
        self._stop.set()
        self._process.join(5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
