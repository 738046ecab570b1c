"""Store write throughput: deltarec's SQLite and PostgreSQL stores vs a bare upsert baseline.

1M rows of dim 64 float32 (by default), keys in random order, written in the publisher's batch
size (8 MB of rows per transaction). For each backend, in the same run and on the same
machine and server:

* SQLite: ``SqliteStore.write`` (checks, versioned upsert, progress mark per batch) vs a bare
  ``executemany`` of ``INSERT ... ON CONFLICT (key) DO UPDATE ... WHERE version <=`` into an
  identical table, one transaction per batch, with the store's pragmas (WAL, synchronous
  NORMAL, the same page cache and WAL checkpoint interval) so the ratio is deltarec's overhead.
* PostgreSQL: ``PostgresStore.write`` vs a bare binary ``COPY`` into a temp table + the same
  ``INSERT ... SELECT ... ON CONFLICT`` merge, one transaction per batch (same server).

Each is measured twice: loading an empty view, then updating every key at a newer version.

Run: ``.venv/bin/python bench/bench_stores.py [--rows N] [--dim D] [--skip-postgres]``
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
from deltarec.stores import ProgressMark, open_store
from deltarec.stores.pgcopy import batch_payload
from deltarec.testing.servers import PostgresServer

TABLE = "sparse.ebc.item_id"
BATCH_BYTES = 8 << 20


def make_rows(n: int, dim: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    keys = rng.permutation(n).astype(np.int64)
    return keys, rng.standard_normal((n, dim), dtype=np.float32)


def batches(n: int, dim: int) -> list[tuple[int, int]]:
    size = max(1, BATCH_BYTES // (4 * dim + 24))
    return [(s, min(n, s + size)) for s in range(0, n, size)]


def run_store(url: str, keys: np.ndarray, emb: np.ndarray, seq: int) -> float:
    n, dim = emb.shape
    store = open_store(url)
    store.provision({TABLE: TableSpec(dim=dim)})
    version = make_version(1, seq)
    ops = np.zeros(n, np.int8)
    versions = np.full(n, version, np.int64)
    start = time.perf_counter()
    done = 0
    for i, (s, e) in enumerate(bench_batches := batches(n, dim)):
        done += e - s
        mark = ProgressMark("bench", 1, seq, TABLE, 0, done, i == len(bench_batches) - 1)
        store.write(TABLE, keys[s:e], emb[s:e], ops[s:e], versions[s:e], mark=mark)
    elapsed = time.perf_counter() - start
    store.close()
    return n / elapsed


def bare_sqlite(path: str, keys: np.ndarray, emb: np.ndarray, seq: int, cache_mb: int) -> float:
    n, dim = emb.shape
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute(f"PRAGMA cache_size = {-1024 * cache_mb}")  # the store's settings
    conn.execute("PRAGMA wal_autocheckpoint = 65536")
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
    for s, e in batches(n, dim):
        now = time.time()
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(
            sql,
            zip(
                keys[s:e].tolist(),
                map(bytes, emb[s:e]),
                itertools.repeat(version, e - s),
                itertools.repeat(now, e - s),
                strict=True,
            ),
        )
        conn.execute("COMMIT")
    elapsed = time.perf_counter() - start
    conn.close()
    return n / elapsed


def bare_postgres(url: str, keys: np.ndarray, emb: np.ndarray, seq: int) -> float:
    import psycopg

    n, dim = emb.shape
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
    ops = np.zeros(n, np.int8)
    versions = np.full(n, version, np.int64)
    start = time.perf_counter()
    for s, e in batches(n, dim):
        payload = batch_payload(keys[s:e], emb[s:e], versions[s:e], ops[s:e], "bytea")
        with conn.transaction(), conn.cursor() as cur:
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


def row(name: str, phase: str, ours: float, base: float) -> str:
    return f"| {name} | {phase} | {ours:,.0f} | {base:,.0f} | {ours / base:.2f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--skip-postgres", action="store_true")
    parser.add_argument("--cache-mb", type=int, default=64, help="SQLite page cache (both)")
    parser.add_argument("--dir", default=None, help="where the SQLite files go (default: /tmp)")
    args = parser.parse_args()
    keys, emb = make_rows(args.rows, args.dim)
    keys2, emb2 = keys[::-1].copy(), make_rows(args.rows, args.dim, seed=1)[1]
    lines = [
        f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; "
        f"machine: {platform.node()} ({os.cpu_count()} cores, {platform.machine()}, load "
        f"average {os.getloadavg()[0]:.1f} at start); "
        f"{args.rows:,} rows, dim {args.dim}, float32, random key order, "
        f"{BATCH_BYTES >> 20} MB batches",
        "",
        "| backend | phase | deltarec rows/s | baseline rows/s | ratio |",
        "|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        url = f"sqlite:///{d}/ours.db?cache_mb={args.cache_mb}"
        ours = [run_store(url, keys, emb, 1), run_store(url, keys2, emb2, 2)]
        base = [
            bare_sqlite(f"{d}/bare.db", keys, emb, 1, args.cache_mb),
            bare_sqlite(f"{d}/bare.db", keys2, emb2, 2, args.cache_mb),
        ]
        where = f", files in {args.dir}" if args.dir else ""
        name = f"SQLite, {args.cache_mb} MB cache{where} (vs bare executemany upsert)"
        lines.append(row(name, "load", ours[0], base[0]))
        lines.append(row(name, "update", ours[1], base[1]))
    if not args.skip_postgres:
        with PostgresServer(fsync=True) as pg:
            ours = [run_store(pg.url, keys, emb, 1), run_store(pg.url, keys2, emb2, 2)]
            base = [bare_postgres(pg.url, keys, emb, 1), bare_postgres(pg.url, keys2, emb2, 2)]
        lines.append(row("PostgreSQL (vs bare COPY + merge)", "load", ours[0], base[0]))
        lines.append(row("PostgreSQL (vs bare COPY + merge)", "update", ours[1], base[1]))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
