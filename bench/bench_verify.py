"""Benchmark: ``verify --all`` of 1M rows of dim 64 (float32) from SQLite.

Builds one generation whose snapshot holds N rows (2 ranks' shards), publishes it into a
SQLite store with the normal publisher, then times :func:`deltarec.verify.verify` with every
key (expected state, sha256 of every shard, reading every key back, comparison, scanning the
store for keys the lineage never wrote). The baseline, measured in the same run on the same
file, is a bare ``SELECT key, embedding, version`` of every row with Python's sqlite3 (no
comparison at all). Target: >= 500k keys/s.

With ``deltas`` > 0, that many delta dumps follow the snapshot, each rewriting about 5% of
every rank's keys (drawn at random) at its own version: the store then holds pages of
sparse-looking versions and the expected rows come from many shards.

usage: .venv/bin/python bench/bench_verify.py [rows] [dim] [deltas]
"""

from __future__ import annotations

import datetime
import os
import platform
import sqlite3
import sys
import tempfile
import time
from collections.abc import Iterator

import numpy as np

from deltarec.artifacts import (
    ArtifactRoot,
    DType,
    DumpKind,
    GenerationInfo,
    Manifest,
    ShardRows,
    TableSpec,
    write_dump,
)
from deltarec.publish import DumpPublisher
from deltarec.stores import open_store
from deltarec.verify import VerifyOptions, verify

TABLE = "sparse.ebc.item_id"
RUN = "bench"
TARGET = 500_000


def _rows(lo: int, hi: int, dim: int, rng: np.random.Generator) -> Iterator[ShardRows]:
    """Keys ``lo:hi`` with random float32 rows at step 0, in chunks of 65536 (generated lazily,
    so the writer holds one chunk at a time)."""
    for start in range(lo, hi, 65536):
        keys = np.arange(start, min(start + 65536, hi), dtype=np.int64)
        values = rng.standard_normal((len(keys), dim), dtype=np.float32)
        n = len(keys)
        yield ShardRows(keys, values, np.zeros(n, np.int8), np.zeros(n, np.int64))


def build(root: ArtifactRoot, rows: int, dim: int) -> tuple[GenerationInfo, Manifest]:
    spec = TableSpec(dim=dim, dtype=DType.FLOAT32, num_embeddings=rows, sharding="row_wise")
    info = root.allocate_generation(GenerationInfo(RUN, 1, 2, {TABLE: spec}))
    rng = np.random.default_rng(0)
    half = rows // 2
    ranks = {0: _rows(0, half, dim, rng), 1: _rows(half, rows, dim, rng)}
    return info, write_dump(root, info, 0, DumpKind.SNAPSHOT, {TABLE: ranks}, 0, 0)


def add_deltas(root: ArtifactRoot, info: GenerationInfo, rows: int, count: int) -> list[Manifest]:
    """``count`` delta dumps after the snapshot, each rewriting ~5% of each rank's keys."""
    rng = np.random.default_rng(1)
    half = rows // 2
    dim = info.tables[TABLE].dim
    out = []
    for seq in range(1, count + 1):
        ranks = {}
        for rank, (lo, hi) in enumerate([(0, half), (half, rows)]):
            keys = np.unique(rng.integers(lo, hi, max(1, (hi - lo) // 20)))
            values = rng.standard_normal((len(keys), dim), dtype=np.float32)
            n = len(keys)
            ranks[rank] = ShardRows(keys, values, np.zeros(n, np.int8), np.full(n, seq, np.int64))
        out.append(write_dump(root, info, seq, DumpKind.DELTA, {TABLE: ranks}, seq, seq))
    return out


def bare_select(path: str, view: str) -> tuple[float, float, int]:
    """Wall and CPU seconds of fetching every row once, and the rows fetched."""
    conn = sqlite3.connect(path)
    try:
        t, c = time.perf_counter(), time.process_time()
        n = 0
        cur = conn.execute(f'SELECT key, embedding, version FROM "{view}"')
        while batch := cur.fetchmany(65536):
            n += len(batch)
        return time.perf_counter() - t, time.process_time() - c, n
    finally:
        conn.close()


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    dim = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    deltas = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    with tempfile.TemporaryDirectory(prefix="deltarec-bench-verify-") as tmp:
        root = ArtifactRoot(os.path.join(tmp, "art"))
        db = os.path.join(tmp, "store.db")
        t = time.perf_counter()
        info, snapshot = build(root, rows, dim)
        manifests = [snapshot, *add_deltas(root, info, rows, deltas)]
        t_build = time.perf_counter() - t
        with open_store(f"sqlite:///{db}", run=RUN) as store:
            t = time.perf_counter()
            publisher = DumpPublisher(store, root, RUN)
            for manifest in manifests:
                for rank in (0, 1):
                    publisher.publish_dump(manifest, rank)
            t_publish = time.perf_counter() - t
            view = store.views()[TABLE].name
            t_base, c_base, n_base = bare_select(db, view)
            load_before = os.getloadavg()[0]
            t, c = time.perf_counter(), time.process_time()
            result = verify(root, RUN, store, options=VerifyOptions(sample=None))
            t_verify, c_verify = time.perf_counter() - t, time.process_time() - c
        assert result.passed, result.failure_summary()
        assert result.checked == rows and n_base == rows
    rate, base_rate = rows / t_verify, rows / t_base
    print(f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}")
    print(f"machine: {platform.node()}, {os.cpu_count()} cores, {platform.processor() or '?'}")
    print(f"python {platform.python_version()}, sqlite {sqlite3.sqlite_version}")
    print(
        f"rows: {rows:,} dim {dim} float32, snapshot + {deltas} deltas "
        f"(build {t_build:.1f}s, publish {t_publish:.1f}s)"
    )
    print(f"load average before verify: {load_before:.1f}, at the end: {os.getloadavg()[0]:.1f}")
    print()
    print("| measurement | wall s | keys/s (wall) | CPU s | keys per CPU s |")
    print("|---|---:|---:|---:|---:|")
    print(
        f"| verify --all (deltarec) | {t_verify:.2f} | {rate:,.0f} | {c_verify:.2f} | "
        f"{rows / c_verify:,.0f} |"
    )
    print(
        f"| baseline: bare SELECT key, embedding, version | {t_base:.2f} | {base_rate:,.0f} | "
        f"{c_base:.2f} | {rows / c_base:,.0f} |"
    )
    print()
    print(
        f"ratio verify / bare SELECT: {rate / base_rate:.2f} (wall), {c_base / c_verify:.2f} (CPU)"
    )
    per_m = 1e6 / rows
    print(f"CPU-s per 1M rows: verify {c_verify * per_m:.2f}, bare SELECT {c_base * per_m:.2f}")
    print(f"target >= {TARGET:,} keys/s: {'met' if rate >= TARGET else 'NOT met'}")


if __name__ == "__main__":
    main()
