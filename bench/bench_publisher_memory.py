"""The in-trainer publisher's working memory when it reads a large dump back from its shards.

A trainer hands a committed dump's rows to its background publisher from memory only when
they are small (the hand-off share of the host budget); a larger dump is read back from the
committed shards by :class:`deltarec.publish.DumpPublisher`. This measures what that read-back
costs in memory, in one process as in a trainer: one rank's part of ``--rows`` rows of dim
``--dim`` float32 (one shard, written first), published into a fresh store (SQLite by default)
while a sampler thread reads this process's RSS every 2 ms. Reported: RSS just before the
publish (the interpreter with every module loaded and one warm-up publish of a small dump done,
as in a running trainer), the peak during it, the difference (the publisher's working memory;
docs/publish.md states what bounds it). The baseline, in the same run: the same rows read with
``iter_shard`` alone (no store).

    python bench/bench_publisher_memory.py [--rows 2000000] [--dim 64] [--store sqlite|postgres]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

from deltarec.artifacts import ArtifactRoot, DType, ShardRows, TableSpec
from deltarec.artifacts.shards import iter_shard
from deltarec.publish import DumpPublisher
from deltarec.publish.parts import READ_BYTES
from deltarec.stores import open_store
from deltarec.testing.dumps import new_generation, random_rows, write_dump

TABLE = "sparse.ebc.item_id"
RUN = "mem"


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_during(fn: Callable[[], object]) -> tuple[float, float, float]:
    """``(rss before, peak rss, seconds)`` of ``fn()``, RSS sampled every 2 ms."""
    before = rss_mb()
    peak = [before]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_mb())
            time.sleep(0.002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    start = time.perf_counter()
    try:
        fn()
    finally:
        seconds = time.perf_counter() - start
        stop.set()
        t.join()
    return before, max(peak[0], rss_mb()), seconds


def _chunks(
    lo: int, hi: int, spec: TableSpec, rng: np.random.Generator, step: int
) -> Iterator[ShardRows]:
    for start in range(lo, hi, 65536):
        keys = rng.permutation(np.arange(start, min(start + 65536, hi), dtype=np.int64))
        yield random_rows(keys, spec, seed=int(rng.integers(1 << 31)), step=step)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--store", choices=("sqlite", "postgres"), default="sqlite")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="deltarec-bench-pubmem-") as tmp:
        root = ArtifactRoot(os.path.join(tmp, "art"))
        spec = TableSpec(dim=a.dim, dtype=DType.FLOAT32, num_embeddings=a.rows)
        info = new_generation(root, RUN, {TABLE: spec}, world_size=1)
        rng = np.random.default_rng(0)
        small = write_dump(
            root, info, 1, {TABLE: {0: _chunks(0, 1000, spec, rng, 1)}}, first_step=1, last_step=1
        )
        big = write_dump(
            root, info, 2, {TABLE: {0: _chunks(0, a.rows, spec, rng, 2)}}, first_step=2, last_step=2
        )
        server = None
        if a.store == "sqlite":
            url = f"sqlite:///{os.path.join(tmp, 'store.db')}"
        else:
            from deltarec.testing.servers import PostgresServer

            server = PostgresServer(fsync=True)
            server.start()
            url = f"{server.url}?schema=pubmem"
        try:
            store = open_store(url, run=RUN)
            publisher = DumpPublisher(store, root, RUN)
            publisher.publish_dump(small, 0)  # warm-up: every module and the store's tables

            def read_only() -> Iterator[int]:
                d = root.dump_dir(RUN, 1, 2)
                size = READ_BYTES // (a.dim * 4)
                for shard in big.shards:
                    for rows in iter_shard(root, d, shard, DType.FLOAT32, size, True, True):
                        yield len(rows)

            base = peak_during(lambda: sum(read_only()))
            pub = peak_during(lambda: publisher.publish_dump(big, 0))
            store.close()
        finally:
            if server is not None:
                server.close()
    mb = a.rows * a.dim * 4 / 2**20
    print(f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"machine: {platform.node()}, {os.cpu_count()} cores; store {a.store}")
    print(f"one rank's part: {a.rows:,} rows, dim {a.dim} float32 ({mb:,.0f} MB of rows)")
    print()
    print("| measure | RSS before MB | peak MB | working MB | s |")
    print("|---|---:|---:|---:|---:|")
    for name, (before, peak, s) in (
        ("baseline: iter_shard of the part alone", base),
        ("DumpPublisher.publish_dump (read back)", pub),
    ):
        print(f"| {name} | {before:.0f} | {peak:.0f} | {peak - before:.0f} | {s:.1f} |")


if __name__ == "__main__":
    main()
