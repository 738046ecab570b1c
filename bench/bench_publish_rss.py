"""Peak memory of ``deltarec publish`` on a large generation (default 10M rows).

Writes a generation with :func:`~deltarec.artifacts.write_dump` (2 ranks, one table, chunks of
64k rows in row groups of ``codec.row_group_rows``, one delta dump), then runs ``deltarec
publish`` into a fresh SQLite store (or, with ``--store postgres`` / ``--store redis``, a
PostgreSQL or Redis server this script starts) as a child process and reads its peak RSS
(``VmHWM``, which the child reports).
Baseline, in the same run: the peak RSS of a child that only imports what ``deltarec
publish`` imports (interpreter + numpy + pyarrow + deltarec), so the difference is what
publishing the rows costs.

Run: ``.venv/bin/python bench/bench_publish_rss.py [--rows N] [--dim D] [--store postgres|redis]``
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import numpy as np

# the same server settings as the write benchmark (bench/ is on the path of a bench script)
from bench_stores import PG_SETTINGS
from deltarec.artifacts import ArtifactRoot, ShardRows, write_dump
from deltarec.artifacts.types import DumpKind, GenerationInfo, Manifest, TableSpec
from deltarec.testing.servers import PostgresServer, RedisServer

TABLE = "sparse.ebc.item_id"
GROUP = 65536


def write_generation(root: ArtifactRoot, rows: int, dim: int) -> Manifest:
    info = root.allocate_generation(
        GenerationInfo(run="big", generation=1, world_size=2, tables={TABLE: TableSpec(dim=dim)})
    )
    rng = np.random.default_rng(0)
    keys = rng.permutation(rows).astype(np.int64)

    def chunks(mine: np.ndarray) -> Iterator[ShardRows]:  # one at a time: bounded memory
        for s in range(0, len(mine), GROUP):
            k = mine[s : s + GROUP]
            values = rng.standard_normal((len(k), dim), dtype=np.float32)
            yield ShardRows(k, values, np.zeros(len(k), np.int8), np.ones(len(k), np.int64))

    ranks = {rank: chunks(keys[rank::2]) for rank in range(2)}
    return write_dump(root, info, 1, DumpKind.DELTA, {TABLE: ranks}, 1, 1, fsync=False)


_PEAK = "deltarec-bench-peak-rss-kb"
_ENTRY = (
    "import sys\n"
    "def peak():\n"
    "    for line in open('/proc/self/status'):\n"
    "        if line.startswith('VmHWM'):\n"
    f"            print('{_PEAK}', line.split()[1], file=sys.stderr)\n"
    "{body}\n"
    "peak()\n"
)


def child_peak_rss_mb(body: str, args: list[str]) -> tuple[float, float]:
    """Run ``body`` in a fresh interpreter; return (its own peak RSS in MB, wall seconds).

    The child reports ``VmHWM`` of its own address space (``ru_maxrss`` of a forked child
    would include the parent's resident set at fork time).
    """
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _ENTRY.format(body=body), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"child failed ({done.returncode}): {done.stderr[-2000:]}")
    kb = [int(line.split()[1]) for line in done.stderr.splitlines() if line.startswith(_PEAK)]
    return kb[-1] / 1024.0, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--workdir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--store", choices=("sqlite", "postgres", "redis"), default="sqlite")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        d = stack.enter_context(tempfile.TemporaryDirectory(dir=args.workdir))
        if args.store == "postgres":
            url = stack.enter_context(PostgresServer(fsync=True, settings=PG_SETTINGS)).url
            name = "PostgreSQL"
        elif args.store == "redis":
            url, name = stack.enter_context(RedisServer()).url, "Redis"
        else:
            url, name = f"sqlite:///{d}/store.db", "SQLite"
        root = ArtifactRoot(f"{d}/art")
        t = time.perf_counter()
        manifest = write_generation(root, args.rows, args.dim)
        gen_s = time.perf_counter() - t
        data_mb = sum(s.bytes for s in manifest.shards) / 1e6
        imports = (
            "import numpy, pyarrow, pyarrow.parquet, deltarec.publish\n"
            f"from deltarec.stores import store_class\nstore_class({args.store!r})"
        )
        base_mb, _ = child_peak_rss_mb(imports, [])
        body = "from deltarec.cli import main\nrc = main(sys.argv[1:])\nassert rc == 0, rc"
        cli = [
            "publish",
            "--artifacts",
            root.uri,
            "--run",
            "big",
            "--store",
            url,
            "--json",
            f"{d}/out.json",
        ]
        peak_mb, wall = child_peak_rss_mb(body, cli)
    print(
        f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; machine: "
        f"{platform.node()} ({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}); "
        f"generation: {args.rows:,} rows, dim "
        f"{args.dim} float32, 2 ranks, {data_mb:,.0f} MB of parquet (written in {gen_s:.0f}s)\n\n"
        "| measure | peak RSS (MB) |\n|---|---|\n"
        f"| `deltarec publish` into {name} ({wall:.0f}s, {args.rows / wall:,.0f} rows/s) "
        f"| {peak_mb:.0f} |\n"
        f"| baseline: interpreter + the same imports | {base_mb:.0f} |\n"
        f"| ratio publish / baseline | {peak_mb / base_mb:.2f} |\n"
        f"| publish peak / parquet size | {peak_mb / data_mb:.3f} |"
    )


if __name__ == "__main__":
    main()
