"""Store write throughput: deltarec's SQLite and PostgreSQL stores vs a bare upsert baseline.

1M rows of dim 64 float32 (by default), keys in random order, written the way the publisher
writes them: ``Store.write_batches`` per transaction of the publisher's default size for the
store kind (``--batch-mb`` overrides it), fed in read chunks of the publisher's read size, each
transaction with its progress mark. For each backend, in the same run and on the same machine
and server, the baseline is the bare version in ONE transaction for all rows:

* SQLite: ``SqliteStore.write_batches`` (checks, versioned upsert, progress mark) vs a bare
  ``executemany`` of ``INSERT ... ON CONFLICT (key) DO UPDATE ... WHERE version <=`` of the
  same rows, in the order given, into an identical table with the store's pragmas (WAL,
  synchronous NORMAL, page size, page cache, WAL checkpoint interval).
* PostgreSQL: ``PostgresStore.write_batches`` vs a bare binary ``COPY`` of all rows (one
  payload built with numpy) into a temp table + one ``INSERT ... SELECT ... ON CONFLICT`` merge
  (same server: production durability, fsync, synchronous commit and full-page writes on;
  ``shared_buffers`` 1 GB).

The PostgreSQL server is warmed up first, as a server in service is (``--cold`` skips it): a
scratch table takes ~1.3 GB of rows by ``COPY`` (so that later writes reuse recycled WAL
segments instead of creating and zero-filling new 16 MB files), is read into
``shared_buffers`` with ``pg_prewarm`` (so the buffer pool's shared memory is mapped), dropped,
and a ``CHECKPOINT`` follows. On a freshly initialized cluster, zero-filling new WAL segments
took ~20 % of the server backend's time in a profile of the update, and first touches of the
buffer pool ~12 %; deltarec and the baseline pay them alike, but they belong to the cluster's
first gigabytes of WAL, not to the write path.

Each is measured ``--repeat`` times (fresh stores each time): loading an empty view, then
updating every key at a newer version; the table shows every run.

Run: ``.venv/bin/python bench/bench_stores.py [--rows N] [--dim D] [--skip-postgres]
[--batch-mb MB] [--dir DIR]``
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import platform
import sqlite3
import tempfile
import time

import numpy as np

from deltarec.artifacts.types import TableSpec
from deltarec.ids import make_version
from deltarec.publish.parts import READ_BYTES
from deltarec.stores import ProgressMark, RowBatch, open_store, store_class
from deltarec.stores.sql.pgcopy import batch_payload
from deltarec.stores.sql.sqlite import PAGE_SIZE
from deltarec.testing.servers import PostgresServer

TABLE = "sparse.ebc.item_id"
PG_SETTINGS = {"shared_buffers": "1GB"}


def make_rows(n: int, dim: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    keys = rng.permutation(n).astype(np.int64)
    return keys, rng.standard_normal((n, dim), dtype=np.float32)


def spans(start: int, stop: int, size: int) -> list[tuple[int, int]]:
    return [(s, min(stop, s + size)) for s in range(start, stop, size)]


def run_store(url: str, keys: np.ndarray, emb: np.ndarray, seq: int, batch_bytes: int) -> float:
    n, dim = emb.shape
    per_row = 4 * dim + 24  # as the publisher sizes them
    store = open_store(url, run="bench")
    store.provision({TABLE: TableSpec(dim=dim)})
    version = make_version(1, seq)
    ops = np.zeros(n, np.int8)
    versions = np.full(n, version, np.int64)
    start = time.perf_counter()
    for lo, hi in spans(0, n, max(1, batch_bytes // per_row)):
        mark = ProgressMark("bench", 1, seq, TABLE, 0, hi, hi == n)
        chunks = (
            RowBatch(keys[s:e], emb[s:e], ops[s:e], versions[s:e])
            for s, e in spans(lo, hi, max(1, READ_BYTES // per_row))
        )
        store.write_batches(TABLE, chunks, mark=mark)
    elapsed = time.perf_counter() - start
    store.close()
    return n / elapsed


def bare_sqlite(path: str, keys: np.ndarray, emb: np.ndarray, seq: int, cache_mb: int) -> float:
    n = emb.shape[0]
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute(f"PRAGMA page_size = {PAGE_SIZE}")  # the store's settings
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute(f"PRAGMA cache_size = {-1024 * cache_mb}")
    conn.execute(f"PRAGMA wal_autocheckpoint = {65536 * 4096 // PAGE_SIZE}")
    conn.execute(
        "CREATE TABLE IF NOT EXISTS t (key INTEGER PRIMARY KEY, embedding BLOB NOT NULL, "
        "version INTEGER NOT NULL, updated_at REAL NOT NULL)"
    )
    sql = (
        "INSERT INTO t (key, embedding, version, updated_at) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (key) DO UPDATE SET embedding = excluded.embedding, "
        "version = excluded.version, updated_at = excluded.updated_at "
        "WHERE excluded.version >= t.version"
    )
    version = make_version(1, seq)
    start = time.perf_counter()
    conn.execute("BEGIN IMMEDIATE")  # one transaction for all rows
    conn.executemany(
        sql,
        zip(
            keys.tolist(),
            map(bytes, emb),
            itertools.repeat(version, n),
            itertools.repeat(time.time(), n),
            strict=True,
        ),
    )
    conn.execute("COMMIT")
    conn.close()  # as the store's time includes its close (a WAL checkpoint)
    elapsed = time.perf_counter() - start
    return n / elapsed


def bare_postgres(url: str, keys: np.ndarray, emb: np.ndarray, seq: int) -> float:
    import psycopg

    n = emb.shape[0]
    conn = psycopg.connect(url, autocommit=True)
    conn.execute(
        "CREATE TABLE IF NOT EXISTS bare_t (key BIGINT PRIMARY KEY, embedding BYTEA NOT NULL, "
        "version BIGINT NOT NULL, updated_at TIMESTAMPTZ NOT NULL)"
    )
    conn.execute(
        "CREATE TEMP TABLE IF NOT EXISTS bare_stage (key BIGINT, embedding BYTEA, "
        "version BIGINT, op SMALLINT) ON COMMIT DELETE ROWS"
    )
    version = make_version(1, seq)
    start = time.perf_counter()
    payload = batch_payload(keys, emb, np.full(n, version, np.int64), np.zeros(n, np.int8), "bytea")
    with conn.transaction(), conn.cursor() as cur:  # one transaction for all rows
        with cur.copy("COPY bare_stage FROM STDIN (FORMAT BINARY)") as cp:
            cp.write(payload)
        cur.execute(
            "INSERT INTO bare_t AS v SELECT key, embedding, version, now() FROM bare_stage "
            "ON CONFLICT (key) DO UPDATE SET embedding = EXCLUDED.embedding, "
            "version = EXCLUDED.version, updated_at = EXCLUDED.updated_at "
            "WHERE v.version <= EXCLUDED.version"
        )
    elapsed = time.perf_counter() - start
    conn.close()
    return n / elapsed


def warm_up(url: str, emb: np.ndarray, wal_mb: int = 1300) -> str:
    """Bring a fresh cluster to a server in service: recycled WAL segments, mapped buffers."""
    import psycopg

    n = emb.shape[0]
    payload = batch_payload(
        np.arange(n, dtype=np.int64), emb, np.ones(n, np.int64), np.zeros(n, np.int8), "bytea"
    )
    per_copy = max(1, n * (emb.shape[1] * 4 + 90) >> 20)  # MB of WAL per COPY, about
    start = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE warm_t (key BIGINT, embedding BYTEA, version BIGINT, op SMALLINT)"
        )
        for _ in range(max(1, -(-wal_mb // per_copy))):
            with conn.cursor() as cur, cur.copy("COPY warm_t FROM STDIN (FORMAT BINARY)") as cp:
                cp.write(payload)
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_prewarm")
        blocks = conn.execute("SELECT pg_prewarm('warm_t')").fetchone()[0]
        conn.execute("DROP TABLE warm_t")
        conn.execute("CHECKPOINT")
        segments = conn.execute("SELECT count(*) FROM pg_ls_waldir()").fetchone()[0]
    return (
        f"warm-up {time.perf_counter() - start:.0f} s: {blocks * 8 >> 10} MB read into "
        f"shared_buffers, {segments} WAL segments"
    )


def copy_ceiling(url: str, keys: np.ndarray, emb: np.ndarray) -> float:
    """Rows/s of a plain binary COPY of the rows, sorted, into a fresh table with its primary
    key: no staging, no merge, no version guard. Not a baseline to compare against (it cannot
    upsert); what this server can ingest at best."""
    import psycopg

    n = emb.shape[0]
    order = np.argsort(keys)
    payload = batch_payload(
        keys[order], emb[order], np.ones(n, np.int64), np.zeros(n, np.int8), "bytea"
    )
    conn = psycopg.connect(url, autocommit=True)
    conn.execute(
        "CREATE TABLE ceiling_t (key BIGINT PRIMARY KEY, embedding BYTEA NOT NULL, "
        "version BIGINT NOT NULL, op SMALLINT) WITH (fillfactor = 50)"
    )
    start = time.perf_counter()
    with (
        conn.transaction(),
        conn.cursor() as cur,
        cur.copy("COPY ceiling_t FROM STDIN (FORMAT BINARY)") as cp,
    ):
        cp.write(payload)
    elapsed = time.perf_counter() - start
    conn.execute("DROP TABLE ceiling_t")
    conn.close()
    return n / elapsed


def row(name: str, phase: str, ours: float, base: float) -> str:
    return f"| {name} | {phase} | {ours:,.0f} | {base:,.0f} | {ours / base:.2f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--skip-postgres", action="store_true")
    parser.add_argument("--skip-sqlite", action="store_true")
    parser.add_argument("--cache-mb", type=int, default=16, help="SQLite page cache (both)")
    parser.add_argument("--dir", default=None, help="where the SQLite files go (default: /tmp)")
    parser.add_argument(
        "--batch-mb", type=int, default=None, help="bytes per transaction (default: publisher's)"
    )
    parser.add_argument(
        "--cold", action="store_true", help="no warm-up of the PostgreSQL server (see above)"
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs of each measurement")
    parser.add_argument(
        "--key-order",
        choices=("random", "sorted"),
        default="random",
        help="order of the rows given to both sides (sorted: as a dump of a plain table)",
    )
    args = parser.parse_args()
    preferred = {k: store_class(k).capabilities.batch_bytes for k in ("sqlite", "postgres")}
    sizes = {k: (args.batch_mb << 20 if args.batch_mb else v) for k, v in preferred.items()}
    keys, emb = make_rows(args.rows, args.dim)
    keys2, emb2 = keys[::-1].copy(), make_rows(args.rows, args.dim, seed=1)[1]
    if args.key_order == "sorted":
        keys, keys2 = np.sort(keys), np.sort(keys2)
    lines = [
        f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; "
        f"machine: {platform.node()} ({os.cpu_count()} cores, {platform.machine()}, load "
        f"average {os.getloadavg()[0]:.1f} at start); "
        f"{args.rows:,} rows, dim {args.dim}, float32, {args.key_order} key order; deltarec writes "
        f"transactions of up to {sizes['sqlite'] >> 20} MB (SQLite) / "
        f"{sizes['postgres'] >> 20} MB (PostgreSQL) in {READ_BYTES >> 20} MB read chunks; the "
        "baselines write all rows in one transaction",
        "",
        "| backend | phase | deltarec rows/s | baseline rows/s | ratio |",
        "|---|---|---|---|---|",
    ]
    for _ in range(0 if args.skip_sqlite else args.repeat):
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            url = f"sqlite:///{d}/ours.db?cache_mb={args.cache_mb}"
            b = sizes["sqlite"]
            ours = [run_store(url, keys, emb, 1, b), run_store(url, keys2, emb2, 2, b)]
            base = [
                bare_sqlite(f"{d}/bare.db", keys, emb, 1, args.cache_mb),
                bare_sqlite(f"{d}/bare.db", keys2, emb2, 2, args.cache_mb),
            ]
            where = f", files in {args.dir}" if args.dir else ""
            name = f"SQLite, {args.cache_mb} MB cache{where} (vs bare executemany upsert)"
            lines.append(row(name, "load", ours[0], base[0]))
            lines.append(row(name, "update", ours[1], base[1]))
    if not args.skip_postgres:
        ceilings: list[float] = []
        warm: list[str] = []
        for _ in range(args.repeat):
            with PostgresServer(fsync=True, settings=PG_SETTINGS) as pg:
                if not args.cold:
                    warm.append(warm_up(pg.url, emb))
                b = sizes["postgres"]
                ours = [run_store(pg.url, keys, emb, 1, b), run_store(pg.url, keys2, emb2, 2, b)]
                base = [bare_postgres(pg.url, keys, emb, 1), bare_postgres(pg.url, keys2, emb2, 2)]
                ceilings.append(copy_ceiling(pg.url, keys, emb))
            lines.append(row("PostgreSQL (vs bare COPY + merge)", "load", ours[0], base[0]))
            lines.append(row("PostgreSQL (vs bare COPY + merge)", "update", ours[1], base[1]))
        lines.append(
            "\nPostgreSQL ingest ceiling (plain COPY of the rows, sorted, into a fresh table "
            "with its primary key; no merge): "
            + ", ".join(f"{c:,.0f}" for c in ceilings)
            + " rows/s"
        )
        lines.append("PostgreSQL server: " + ("; ".join(warm) if warm else "cold (--cold)"))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
