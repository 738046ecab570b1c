"""Benchmark: serving's read latency while a generation lands, with and without a read budget.

For each store (SQLite, PostgreSQL, Redis, the servers started as the test fixtures start
them: :mod:`deltarec.testing.servers`), in a fresh namespace per trial (a SQLite file, a
PostgreSQL schema, a Redis key prefix):

1. dump 1 of a generation (a snapshot of ``--rows`` keys of dim ``--dim``) is published, so
   serving has rows to read;
2. a **reader process** starts: ``--clients`` threads, each with its own connection, issuing
   point reads of random keys of dump 1 on the serving name, the way a serving client reads
   (``SELECT embedding, version FROM emb_<table> WHERE key = ?`` (``= ANY`` for a multi-get),
   ``HGET`` / ``HMGET emb:<table>``) at a fixed offered rate (``--rate`` reads a second in all,
   on a fixed schedule). A read's latency is from its request to its reply (the figures
   printed); ``phases_from_due`` in the JSON counts from when it was due, so a read held up
   behind a slow one, or by a client starved of CPU, counts its wait too;
3. after ``--before`` seconds, ``deltarec publish`` (a subprocess, as an operator runs it)
   lands dump 2, a delta rewriting every key (``--rows`` rows, a new version), with or
   without ``--read-p99-ms``; ``--after`` seconds later the readers stop;
4. the serving name is compared key by key with the artifacts (every key of dump 2: its
   embedding and version; ``--no-check`` skips it): nothing lost or wrong under the budget.

The budget is ``--budget-x`` times the readers' idle p99, measured on that store in a
calibration window before its first trial. Trials alternate (none, budget, none, ...; the
machine is shared, so alternating spreads its load over both) ``--repeat`` times each; with
``--yield-cpu both`` each repeat is none, budget with the publisher's threads yielding the CPU
(its default), budget with ``--no-yield-cpu``.
Printed per trial: the readers' p50 / p99 / max per second, then per phase (before, during,
after), the longest single read, the publish rate, the held-back seconds and the probes'
figures; the load average before and after. ``--json`` writes everything.

**Freshness** (``--fresh-dumps N``): then the trainer's publisher, with and without the budget:
a :class:`~deltarec.publish.BackgroundPublisher` is handed a delta dump of ``--fresh-rows``
random keys (rows in memory, as the dumper hands them over) every ``--fresh-every`` seconds
while the readers read; the freshness of each (its ``taken_at`` to visible) gives p50 / p99.

usage: .venv/bin/python bench/bench_readers.py [--rows 2000000] [--dim 64] [--clients 4]
           [--rate 1000] [--keys-per-read 1] [--stores sqlite,postgres,redis]
           [--budget-x 2] [--repeat 1] [--before 5] [--after 5] [--json PATH]
           [--fresh-dumps N] [--fresh-rows 50000] [--fresh-every 2] [--skip-publish]
           [--no-aof-rewrite] [--yield-cpu on|off|both]
           [--pin readers=0-3,server=4-7,publisher=8-15] [--redis-aof disk|shm|nofsync|off]

``--pin``: on a machine of many cores, the reader process, the server (every process and
thread of it) and the ``deltarec publish`` process each on CPUs of their own
(``sched_setaffinity``), so that none waits for a core behind another (the calibration's
readers and server too).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

from deltarec.artifacts import ArtifactRoot, DumpKind, ShardRows, TableSpec, utc_now, write_dump
from deltarec.artifacts.lineage import expected_state
from deltarec.publish import DumpPublisher
from deltarec.stats import quantile
from deltarec.stores import open_store
from deltarec.testing.dumps import new_generation
from deltarec.testing.servers import PostgresServer, RedisServer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import provenance
from readers_server import (
    ServerWatch,
    describe,
    move_aof,
    parse_pin,
    pin_process_tree,
    queues_now,
    queues_since,
)

RUN, TABLE = "bench", "sparse.ebc.item_id"
CHUNK = 1 << 18  # rows per shard row group written


# ---- the artifacts -----------------------------------------------------------------------
def _chunks(keys: np.ndarray, dim: int, seed: int):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    for s in range(0, len(keys), CHUNK):
        k = keys[s : s + CHUNK]
        emb = rng.standard_normal((len(k), dim), np.float32)
        yield ShardRows(k, emb, np.zeros(len(k), np.int8), np.zeros(len(k), np.int64))


def make_artifacts(path: str, rows: int, dim: int) -> tuple[ArtifactRoot, np.ndarray]:
    """Dump 1 (a snapshot) and dump 2 (a delta rewriting every key) of one generation."""
    root = ArtifactRoot(path)
    spec = TableSpec(dim=dim, num_embeddings=rows * 4)
    info = new_generation(root, RUN, {TABLE: spec}, world_size=1)
    keys = np.sort(np.random.default_rng(0).choice(rows * 4, rows, replace=False)).astype(np.int64)
    order = np.random.default_rng(1).permutation(rows)
    for seq, kind in ((1, DumpKind.SNAPSHOT), (2, DumpKind.DELTA)):
        write_dump(
            root, info, seq, kind, {TABLE: {0: _chunks(keys[order], dim, seq)}}, seq, seq,
            extra={"taken_at": utc_now()}, fsync=False,
        )  # fmt: skip
    return root, keys


# ---- the readers -------------------------------------------------------------------------
def _connect(kind: str, target: dict[str, Any]):  # type: ignore[no-untyped-def]
    """One serving client: a function reading a list of keys from the serving name."""
    name = target["name"]
    if kind == "sqlite":
        import sqlite3

        conn = sqlite3.connect(target["path"], timeout=30, check_same_thread=False)
        one = f"SELECT embedding, version FROM {name} WHERE key = ?"
        many = f"SELECT key, embedding, version FROM {name} WHERE key IN "
        return lambda keys: (
            conn.execute(one, (keys[0],)).fetchall()
            if len(keys) == 1
            else conn.execute(many + "(" + ",".join("?" * len(keys)) + ")", keys).fetchall()
        )
    if kind == "postgres":
        import psycopg

        pg = psycopg.connect(target["url"], autocommit=True)
        one = f"SELECT embedding, version FROM {name} WHERE key = %s"
        many = f"SELECT key, embedding, version FROM {name} WHERE key = ANY(%s)"
        return lambda keys: (
            pg.execute(one, (keys[0],), prepare=True).fetchall()
            if len(keys) == 1
            else pg.execute(many, (keys,), prepare=True).fetchall()
        )
    import redis

    client = redis.Redis(host="127.0.0.1", port=target["port"])
    return lambda keys: (
        client.hget(name, str(keys[0])) if len(keys) == 1 else client.hmget(name, keys)
    )


def _client(kind, target, keys, rate, per_read, stop, out, seed):  # type: ignore[no-untyped-def]
    read = _connect(kind, target)
    rng = random.Random(seed)
    interval = 1.0 / rate
    due = time.time() + rng.random() * interval
    got = []
    while not stop.is_set():
        wait = due - time.time()
        if wait > 0:
            time.sleep(wait)
        pick = [int(keys[rng.randrange(len(keys))]) for _ in range(per_read)]
        sent = time.time()
        read(pick)
        done = time.time()
        got.append((due, done - due, done - sent))
        due += interval
    out.extend(got)


def _reader_main(kind, target, keys, clients, rate, per_read, stop, queue, cpus):  # type: ignore[no-untyped-def]
    """The reader process: ``clients`` threads; sends back [(due, response, service)]."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    out: list[tuple[float, float, float]] = []
    threads = [
        threading.Thread(
            target=_client, args=(kind, target, keys, rate / clients, per_read, stop, out, i)
        )
        for i in range(clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    queue.put(out)


class Readers:
    """The reader process, started and stopped around one trial."""

    def __init__(self, kind: str, target: dict[str, Any], keys: np.ndarray, args: Any) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._queue = ctx.Queue()
        sample = keys[np.random.default_rng(7).choice(len(keys), min(len(keys), 200_000))]
        self._process = ctx.Process(
            target=_reader_main,
            args=(kind, target, sample, args.clients, args.rate, args.keys_per_read, self._stop,
                  self._queue, args.pin.get("readers")),
        )  # fmt: skip
        self._process.start()
        self.pid = self._process.pid

    def stop(self) -> list[tuple[float, float, float]]:
        self._stop.set()
        got = self._queue.get(timeout=120)
        self._process.join(30)
        return sorted(got)


# ---- one trial ---------------------------------------------------------------------------
def _stats(lat: list[float]) -> dict[str, Any]:
    if not lat:
        return {"n": 0}
    s = sorted(lat)
    return {
        "n": len(s),
        "p50_ms": round(quantile(s, 0.5) * 1e3, 3),
        "p99_ms": round(quantile(s, 0.99) * 1e3, 3),
        "max_ms": round(s[-1] * 1e3, 3),
    }


def _publish(
    root: str, url: str, budget_ms: float | None, yield_cpu: bool, cpus: list[int] | None = None
) -> dict[str, Any]:
    cmd = [sys.executable, "-c", "import sys; from deltarec.cli import main; sys.exit(main())",
           "publish", "--artifacts", root, "--run", RUN,
           "--store", url, "--generation", "1", "--json", "-"]  # fmt: skip
    if budget_ms is not None:
        cmd += ["--read-p99-ms", f"{budget_ms:.4f}"]
        if not yield_cpu:
            cmd += ["--no-yield-cpu"]
    done = subprocess.run(
        cmd, capture_output=True, text=True, check=True,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
    )  # fmt: skip
    return dict(json.loads(done.stdout))


_PG_COUNTERS = {
    # the server's own work that can hold every reader: checkpoints, the buffers they and the
    # backends wrote, the WAL (its buffers full: a backend writing WAL itself), autovacuum
    "pg_stat_bgwriter": "*",
    "pg_stat_checkpointer": "*",  # PostgreSQL 17 moved the checkpoints' counters here
    "pg_stat_wal": "wal_records, wal_fpi, wal_bytes, wal_buffers_full",
}


def _pg_stats(target: dict[str, Any]) -> dict[str, int]:
    import psycopg

    out: dict[str, int] = {}
    with psycopg.connect(target["url"], autocommit=True) as conn:
        for view, cols in _PG_COUNTERS.items():
            try:
                cur = conn.execute(f"SELECT {cols} FROM {view}")
            except psycopg.errors.UndefinedTable:
                continue
            row = cur.fetchone()
            names = [d.name for d in cur.description or []]
            for name, value in zip(names, row or (), strict=True):
                if isinstance(value, (int, float)) or type(value).__name__ == "Decimal":
                    out[name] = int(value)
        row = conn.execute(
            "SELECT coalesce(sum(autovacuum_count + autoanalyze_count), 0) FROM pg_stat_all_tables"
        ).fetchone()
        out["autovacuum_runs"] = int(row[0]) if row else 0
    return out


def server_stats(kind: str, target: dict[str, Any]) -> dict[str, int]:
    """The server's own stalls, which no budget can avoid. Redis: forks (the append-only
    file's rewrite copies the page tables of the whole data set) and writes of the file
    delayed by its fsync; PostgreSQL: checkpoints, buffers written, WAL, autovacuum.
    """
    if kind == "postgres":
        return _pg_stats(target)
    if kind != "redis":
        return {}
    import redis

    info: Any = redis.Redis(host="127.0.0.1", port=target["port"]).info()
    names = ("total_forks", "latest_fork_usec", "aof_delayed_fsync", "aof_rewrites")
    return {n: int(info.get(n, 0)) for n in names}


def check_exact(url: str, root: ArtifactRoot) -> dict[str, Any]:
    """The serving name compared key by key with the generation's expected state (every key of
    dump 2: its embedding and version), after the readers stopped."""
    t = time.time()
    table = expected_state(root, RUN, 1).tables[TABLE]
    keys = table.present_keys()
    wrong = missing = 0
    with open_store(url) as store:  # no run: what serving reads
        for s in range(0, len(keys), 100_000):
            k = keys[s : s + 100_000]
            got = store.read(TABLE, k)
            missing += int((~got.found).sum())
            same = (got.embedding == table.load(k)).all(axis=1)
            same &= got.versions == table.versions[table.index_of(k)]
            wrong += int((got.found & ~same).sum())
    return {
        "rows": len(keys), "missing": missing, "wrong": wrong, "exact": not (missing or wrong),
        "check_s": round(time.time() - t, 1),
    }  # fmt: skip


def trial(kind, url, target, root, keys, args, budget_ms, window=None, yield_cpu=True):  # type: ignore[no-untyped-def]
    """Preload dump 1, start the readers, publish dump 2 in the middle; the figures.

    ``window``: seconds of readers alone, nothing published (the idle calibration).
    ``yield_cpu``: under the budget, the publisher's threads at the lowest CPU priority.
    """
    store = open_store(url, root.uri, run=RUN)
    pub = DumpPublisher(store, root, RUN)
    pub.publish_dump(root.read_manifest(RUN, 1, 1), 0)
    store.close()
    readers = Readers(kind, target, keys, args)
    time.sleep(2.0)  # the reader process imports and connects
    t0 = time.time()
    if window is not None:
        time.sleep(window)
        lat = [x for d, _, x in readers.stop() if d >= t0]
        return {"idle": _stats(lat)}
    queues = queues_now({"server": target.get("pid"), "readers": readers.pid})
    time.sleep(args.before)
    queues_before = queues_since(queues, time.time() - t0)
    load = os.getloadavg()
    stats = server_stats(kind, target)
    watch = ServerWatch(kind, target.get("port"), target.get("pid"), readers.pid)
    watch.start()
    p0 = time.time()
    result = _publish(root.uri, url, budget_ms, yield_cpu, args.pin.get("publisher"))
    p1 = time.time()
    diag = watch.stop()
    diag["run_queue_before"] = queues_before
    stats_after = server_stats(kind, target)
    time.sleep(args.after)
    got = [(d, x, y) for d, x, y in readers.stop() if d >= t0]
    exact = None if args.no_check else check_exact(url, root)
    spans = {"before": (t0, p0), "during": (p0, p1), "after": (p1, float("inf"))}
    seconds = []
    for s in range(int(got[-1][0] - t0) + 1):
        lat = [y for d, _, y in got if t0 + s <= d < t0 + s + 1]
        phase = "during" if p0 - t0 <= s + 0.5 < p1 - t0 else ("before" if s < p0 - t0 else "after")
        seconds.append({"s": s, "phase": phase, **_stats(lat)})
    longest = max(got, key=lambda g: g[2])
    longest_during = max((g for g in got if p0 <= g[0] < p1), key=lambda g: g[2])
    diag["longest_reads"] = [
        (round(d - p0, 3), round(y * 1e3, 2)) for d, _, y in sorted(got, key=lambda g: -g[2])[:8]
    ]
    return {
        "budget_ms": budget_ms,
        "yield_cpu": yield_cpu if budget_ms is not None else None,
        "load_before_publish": [round(x, 2) for x in load],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "phases": {k: _stats([y for d, _, y in got if a <= d < b]) for k, (a, b) in spans.items()},
        "phases_from_due": {
            k: _stats([x for d, x, _ in got if a <= d < b]) for k, (a, b) in spans.items()
        },
        "longest_read_ms": round(longest[2] * 1e3, 3),
        "longest_read_at_s": round(longest[0] - p0, 3),
        "longest_during_ms": round(longest_during[2] * 1e3, 3),
        "publish_s": round(p1 - p0, 3),
        "publish_rows": result["rows"],
        "publish_rows_per_s": round(result["rows"] / (p1 - p0)),
        "budget": result.get("budget"),
        "server_during": {
            k: (v if k == "latest_fork_usec" else v - stats[k]) for k, v in stats_after.items()
        },
        "server_watch": diag,
        "per_second": seconds,
        "exact": exact,
    }


# ---- freshness: the trainer's background publisher -----------------------------------------
def freshness_trial(kind, url, target, root, keys, args, budget_ms):  # type: ignore[no-untyped-def]
    """Dumps of ``--fresh-rows`` keys every ``--fresh-every`` s, published by the trainer's
    background publisher (rows from memory) while the readers read; freshness and readers."""
    from deltarec.artifacts.types import Manifest
    from deltarec.publish import BackgroundPublisher

    store = open_store(url, root.uri, run=RUN)
    DumpPublisher(store, root, RUN).publish_dump(root.read_manifest(RUN, 1, 1), 0)
    store.close()
    info = root.read_generation(RUN, 1)
    readers = Readers(kind, target, keys, args)
    time.sleep(2.0)
    t0 = time.time()
    bg = BackgroundPublisher(url, root.uri, RUN, 0, 1, read_p99_ms=budget_ms)
    rng = np.random.default_rng(5)
    for i in range(args.fresh_dumps):
        due = t0 + i * args.fresh_every
        time.sleep(max(0.0, due - time.time()))
        pick = np.sort(rng.choice(keys, args.fresh_rows, replace=False))
        rows = next(_chunks(pick, args.dim, 100 + i))
        seq = 100 + i  # after dumps 1 and 2
        m: Manifest = write_dump(
            root, info, seq, DumpKind.DELTA, {TABLE: {0: rows}}, seq, seq,
            extra={"taken_at": utc_now()}, fsync=False,
        )  # fmt: skip
        bg.submit(m, {TABLE: rows})
    bg.close(timeout=900)
    p1 = time.time()
    time.sleep(1.0)
    got = [(d, y) for d, _, y in readers.stop() if d >= t0]
    fresh = sorted(float(r.freshness_s) for r in bg.results if r.freshness_s is not None)
    for seq in range(100, 100 + args.fresh_dumps):  # the next trial writes them again
        shutil.rmtree(root.dump_dir(RUN, 1, seq), ignore_errors=True)
    report = None if bg.throttle is None else bg.throttle.close().to_json()
    return {
        "budget_ms": budget_ms,
        "load": [round(x, 2) for x in os.getloadavg()],
        "readers_during": _stats([x for d, x in got if d < p1]),
        "freshness_p50_s": round(quantile(fresh, 0.5), 3),
        "freshness_p99_s": round(quantile(fresh, 0.99), 3),
        "freshness_max_s": round(fresh[-1], 3),
        "dumps": len(fresh),
        "budget": report,
    }


# ---- the stores --------------------------------------------------------------------------
@contextlib.contextmanager
def namespace(kind: str, server: Any, work: str, n: int):  # type: ignore[no-untyped-def]
    """A fresh store URL and its serving name for one trial; dropped afterwards."""
    if kind == "sqlite":
        path = os.path.join(work, f"s{n}.db")
        yield f"sqlite:///{path}", {"path": path, "name": "emb_sparse_ebc_item_id"}
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path + suffix)
    elif kind == "postgres":
        schema = f"bench{n}"
        with open(os.path.join(server.datadir, "postmaster.pid")) as f:
            postmaster = int(f.readline())
        yield f"{server.url}?schema={schema}", {
            "url": server.url, "name": f"{schema}.emb_sparse_ebc_item_id", "pid": postmaster
        }  # fmt: skip
        import psycopg

        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")
    else:
        prefix = f"b{n}:"
        yield f"{server.url}?prefix={prefix}", {
            "port": server.port, "name": f"{prefix}{TABLE}", "pid": server.proc.pid
        }  # fmt: skip
        import redis

        client = redis.Redis(host="127.0.0.1", port=server.port)
        client.flushall()
        if str(client.config_get("dir")["dir"]).startswith("/dev/shm/"):
            client.bgrewriteaof()  # the file in memory shrinks back to the empty data set


@contextlib.contextmanager
def server_for(  # type: ignore[no-untyped-def]
    kind: str, no_aof_rewrite: bool = False, cpus: list[int] | None = None, aof: str = "disk"
):
    """The server of ``kind`` as the fixtures start it; every thread of it on ``cpus`` if given."""
    if kind == "postgres":
        with PostgresServer() as pg:
            if cpus:
                with open(os.path.join(pg.datadir, "postmaster.pid")) as f:
                    print(
                        f"postgres: {pin_process_tree(int(f.readline()), cpus)} threads on {cpus}"
                    )
            yield pg
    elif kind == "redis":
        with RedisServer() as rd:
            if cpus:
                assert rd.proc is not None
                print(f"redis: {pin_process_tree(rd.proc.pid, cpus)} threads on {cpus}")
            if no_aof_rewrite:  # the server's own fork out of the figures (see --no-aof-rewrite)
                import redis

                redis.Redis(host="127.0.0.1", port=rd.port).config_set(
                    "auto-aof-rewrite-percentage", 0
                )
            folder = move_aof(rd.port, aof) if aof != "disk" else rd.base
            if aof != "disk":
                print(f"redis: append-only file {aof} (dir {folder})")
            try:
                yield rd
            finally:
                rd.stop()
                if folder != rd.base:
                    shutil.rmtree(folder, ignore_errors=True)
    else:
        yield None


def _line(name: str, r: dict[str, Any]) -> str:
    ph = r["phases"]

    def f(p: str) -> str:
        s = ph[p]
        return f"{s.get('p50_ms', '-')}/{s.get('p99_ms', '-')}/{s.get('max_ms', '-')}"

    b = r["budget"] or {}
    held = b.get("held_back_s", "-")
    if "writing_s" in b:  # where the budgeted publish's time went
        units = b.get("smallest_unit_rows")
        units = "" if units is None else f", units {units}/{b.get('last_unit_rows')}"
        server = "" if b.get("server_s") is None else f", server {b['server_s']}"
        held = f"{held} writing {b['writing_s']} ({b['transactions']} txns{units}{server})"
    during = r.get("server_during", {})
    many = len(during) > 4  # PostgreSQL's counters: those that moved
    server = " ".join(f"{k} {v}" for k, v in during.items() if v or not many)
    e = r.get("exact")
    if e is not None:  # the store against the artifacts, key by key
        exact = "exact" if e["exact"] else f"NOT EXACT ({e['missing']} missing, {e['wrong']} wrong)"
        server = f"{exact} ({e['rows']:,} rows)  {server}"
    return (
        f"{name:22s} before {f('before'):>20s}  during {f('during'):>22s}  after "
        f"{f('after'):>20s}  longest {r['longest_read_ms']:.2f} ms (during the publish "
        f"{r['longest_during_ms']:.2f})  publish "
        f"{r['publish_rows_per_s']:,} rows/s ({r['publish_s']:.1f} s)  held {held}  "
        f"load {r['load_before_publish'][0]}/{r['load_after'][0]}  {server}"
    )


def summary(kind: str, budget: float, runs: list[dict[str, Any]]) -> str:
    """The targets of issue 45 over the trials of one store: p99 and worst read against the
    budget, the publish rate against the rate without it (means over the trials), a line for
    the budget with the publisher's threads at the lowest CPU priority and one without."""
    without = [r for r in runs if r["budget_ms"] is None]
    lines = []
    for yielding in (True, False):
        with_b = [r for r in runs if r["budget_ms"] is not None and r["yield_cpu"] == yielding]
        if not with_b:
            continue
        if not without:
            return f"{kind}: no pair of trials"
        rate = np.mean([r["publish_rows_per_s"] for r in with_b]) / np.mean(
            [r["publish_rows_per_s"] for r in without]
        )
        p99 = max(r["phases"]["during"]["p99_ms"] for r in with_b)
        worst = max(r.get("longest_during_ms", r["longest_read_ms"]) for r in with_b)
        # the same reads counted from when each was due: a client behind its schedule after
        # a slow read counts its lateness (what a serving client at a fixed rate would see)
        due = max(r["phases_from_due"]["during"]["p99_ms"] for r in with_b)
        lines.append(
            f"{kind} ({'yield-cpu' if yielding else 'no-yield-cpu'}, {len(with_b)} trials): "
            f"budget {budget} ms; with it p99 during {p99} ms ({p99 / budget:.2f}x the "
            f"budget, target <= 1; from when due {due} ms), worst read during {worst} ms "
            f"({worst / budget:.1f}x, "
            f"target <= 4), "
            f"publish rate {rate:.2f}x of without (target >= 0.5)"
        )
    checked = [r["exact"] for r in runs if r.get("exact") is not None]
    if checked:
        wrong = sum(not e["exact"] for e in checked)
        lines.append(
            f"{kind}: the serving name after {len(checked)} publishes compared key by key with "
            f"the artifacts: " + (f"{wrong} NOT EXACT" if wrong else "every one exact")
        )
    return "\n".join(lines) or f"{kind}: no pair of trials"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--rate", type=float, default=1000.0, help="reads a second, all clients")
    p.add_argument("--keys-per-read", type=int, default=1)
    p.add_argument("--stores", default="sqlite,postgres,redis")
    p.add_argument("--budget-x", type=float, default=2.0)
    p.add_argument("--budget-ms", type=float, default=None, help="a fixed budget instead")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--before", type=float, default=5.0)
    p.add_argument("--after", type=float, default=5.0)
    p.add_argument("--calibrate", type=float, default=5.0)
    p.add_argument("--fresh-dumps", type=int, default=0, help="dumps of the freshness trial")
    p.add_argument("--fresh-rows", type=int, default=50_000)
    p.add_argument("--fresh-every", type=float, default=2.0)
    p.add_argument("--skip-publish", action="store_true", help="only the freshness trials")
    p.add_argument(
        "--no-aof-rewrite",
        action="store_true",
        help="Redis never rewrites its append-only file by itself (auto-aof-rewrite-percentage "
        "0): no fork of the whole data set (tens of ms, every client waiting) lands in a trial",
    )
    p.add_argument(
        "--yield-cpu",
        choices=("on", "off", "both"),
        default="on",
        help="under the budget the publisher's threads run at the lowest CPU priority (on, the "
        "publisher's default), keep theirs (off: --no-yield-cpu), or both: each repeat is "
        "then a trial without the budget, one with it yielding and one with it not",
    )
    p.add_argument(
        "--redis-aof",
        choices=("disk", "shm", "nofsync", "off"),
        default="disk",
        help="Redis's append-only file as the fixtures keep it (disk), on tmpfs (shm: its "
        "writes never wait for the disk), on the disk with appendfsync no (nofsync) or off",
    )
    p.add_argument(
        "--pin",
        default=None,
        help="CPUs of their own for the readers, the server and the publisher, e.g. "
        "readers=0-3,server=4-7,publisher=8-15 (any of the three; unpinned by default)",
    )
    p.add_argument(
        "--no-check", action="store_true",
        help="skip comparing the serving name key by key with the artifacts after each publish",
    )  # fmt: skip
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    args.pin = parse_pin(args.pin)
    work = tempfile.mkdtemp(prefix="bench-readers-", dir=args.dir)
    commit = provenance.commit()
    print(
        provenance.header("bench_readers", commit) + f", {args.rows:,} rows dim "
        f"{args.dim}, {args.clients} clients at {args.rate:g} reads/s, "
        f"{args.keys_per_read} key(s) a read; load {os.getloadavg()}"
        + (f"; pinned {args.pin}" if args.pin else "")
    )
    out: dict[str, Any] = {"args": vars(args), "commit": commit, "stores": {}}
    # a `timeout` stops the run with SIGTERM: leave through the `with`s, which stop the servers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        t = time.time()
        root, keys = make_artifacts(os.path.join(work, "art"), args.rows, args.dim)
        print(f"artifacts written in {time.time() - t:.1f} s")
        n = 0
        for kind in args.stores.split(","):
            with server_for(
                kind, args.no_aof_rewrite, args.pin.get("server"), args.redis_aof
            ) as server:
                runs: list[dict[str, Any]] = []
                n += 1
                with namespace(kind, server, work, n) as (url, target):
                    idle = trial(kind, url, target, root, keys, args, None, args.calibrate)
                budget = args.budget_ms or round(args.budget_x * idle["idle"]["p99_ms"], 3)
                print(f"{kind}: idle readers {idle['idle']}; budget {budget} ms")
                modes = {"on": [True], "off": [False], "both": [True, False]}[args.yield_cpu]
                plan = [(None, True)] + [(budget, y) for y in modes]  # one repeat
                for i in range(0 if args.skip_publish else args.repeat):
                    for budget_ms, yielding in plan:
                        n += 1
                        with namespace(kind, server, work, n) as (url, target):
                            r = trial(kind, url, target, root, keys, args, budget_ms, None,
                                      yielding)  # fmt: skip
                        runs.append(r)
                        out["stores"][kind] = {"idle": idle["idle"], "budget_ms": budget,
                                               "runs": runs}  # fmt: skip
                        _write_json(args.json, out)  # each trial's as soon as it is done
                        what = "none" if budget_ms is None else (
                            "budget" if yielding else "budget-noyield")  # fmt: skip
                        print(_line(f"{kind} {what} #{i + 1}", r))
                        watched = r["server_watch"]
                        print(f"    {describe(watched)}; longest reads (s, ms) "
                              f"{watched['longest_reads'][:5]}")  # fmt: skip
                        sys.stdout.flush()
                fresh = []
                for i in range(args.repeat * 2 if args.fresh_dumps else 0):
                    n += 1
                    with namespace(kind, server, work, n) as (url, target):
                        f = freshness_trial(
                            kind, url, target, root, keys, args, budget if i % 2 else None
                        )
                    fresh.append(f)
                    print(f"{kind} freshness {'budget' if i % 2 else 'none'}: {f}")
                    sys.stdout.flush()
                if runs:
                    print(summary(kind, budget, runs))
                out["stores"][kind] = {
                    "idle": idle["idle"], "budget_ms": budget, "runs": runs, "freshness": fresh
                }  # fmt: skip
                _write_json(args.json, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"load at the end {os.getloadavg()}")
    _write_json(args.json, out)


def _write_json(path: str | None, out: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
