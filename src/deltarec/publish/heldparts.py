"""Small parts read whole, on a few threads, before anything of them is written.

A dump of hundreds of ranks has thousands of small shards. Streaming each rank's part through
its own read-ahead thread, with a second thread for each shard's sha256 and a first pass that
reads every table but the first twice (once to check, once to write), cost about 5 ms a shard
whatever its rows: 5,120 shards of 900k rows published 28 times slower than 40 shards of the
same rows. When the pending parts' shards are small together (``HELD_BYTES``), they are read
here once instead: each shard opened once, its bytes checked against the manifest's sha256 and
size before they are decoded (:func:`~deltarec.artifacts.wholeshard.read_whole_shard`), every
row checked, all of it before the first write, as the streaming path does.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

import pyarrow as pa

from deltarec.artifacts import shardpool
from deltarec.artifacts.shards import ShardRows
from deltarec.artifacts.types import Manifest, ShardInfo, TableSpec
from deltarec.artifacts.wholeshard import WHOLE_SHARD_BYTES, read_whole_table
from deltarec.errors import InvalidRowError
from deltarec.publish.rows import TablePart

if TYPE_CHECKING:
    from deltarec.publish.face import PublisherFace

HELD_BYTES = 256 << 20
"""At most this many shard bytes of one dump's pending parts are read whole and held."""
READERS = min(4, os.cpu_count() or 1)
"""Threads reading shards (the sha256 and Arrow's decoding leave the interpreter)."""
THREADED_BYTES = 1 << 20
"""Shards this large on average are read on ``READERS`` threads; smaller ones on the calling
thread. A small shard's read is a dozen short calls that each give up the interpreter lock and
wait to take it back (up to its 5 ms switch interval while another reader holds it): 5,120
shards of 16 KB read in 1.8 s on one thread, and took 12 s on four."""

_T = TypeVar("_T")
_R = TypeVar("_R")


def on_readers(fn: Callable[[_T], _R], jobs: Sequence[_T], nbytes: int) -> list[_R]:
    """``fn`` of every job, results in the jobs' order.

    On ``READERS`` threads if the jobs' shards (``nbytes`` in all) are large
    (``THREADED_BYTES`` on average), else on this thread.
    """
    if len(jobs) < 2 or nbytes < THREADED_BYTES * len(jobs):
        return [fn(job) for job in jobs]
    with ThreadPoolExecutor(READERS, thread_name_prefix="deltarec-read") as pool:
        return list(pool.map(fn, jobs))


def read_parts(
    pub: PublisherFace,
    manifest: Manifest,
    ranks: list[int],
    tables: list[tuple[str, TableSpec]],
) -> dict[str, list[ShardRows]] | None:
    """``ranks``' rows of ``tables``, checked, by table in rank order; None if too large to hold.

    Raises:
        ChecksumError: a shard's bytes differ from the manifest's sha256 or size.
        ArtifactError: a shard is missing, outside its dump, or not readable parquet.
        InvalidRowError: a row cannot be published.
    """
    groups = [
        [shard for rank in ranks for shard in manifest.shards_of_rank(table, rank)]
        for table, _ in tables
    ]
    sizes = [shard.bytes for group in groups for shard in group]
    if sum(sizes) > HELD_BYTES or any(size > WHOLE_SHARD_BYTES for size in sizes):
        return None
    dump_dir = pub.root.dump_dir(pub.run, manifest.generation, manifest.seq)
    where = f"run {pub.run!r} generation {manifest.generation} dump {manifest.seq} rank"
    read = functools.partial(read_whole_table, pub.root, dump_dir)
    held: dict[str, list[ShardRows]] = {}
    for (table, spec), group, got in zip(tables, groups, _read(groups, read, pub), strict=True):
        # one conversion and one check per table; a bad row is then found shard by shard, so
        # that its message names the rank
        rows = _rows(spec, got)
        try:
            TablePart(pub.root, manifest, 0, table, spec).check(rows, f"{where}s {ranks}")
        except InvalidRowError:
            first = 0
            for shard in group:  # each shard's row count is its manifest's (read_whole_table)
                part = TablePart(pub.root, manifest, shard.rank, table, spec)
                part.check(rows.slice(first, first + shard.rows), f"{where} {shard.rank}")
                first += shard.rows
            raise
        held[table] = [rows]
    return held


def _read(
    groups: list[list[ShardInfo]], read: Callable[[ShardInfo], pa.Table], pub: PublisherFace
) -> list[list[pa.Table]]:
    """Each group's shards read by ``read``: tables whose rows, in order, are the group's.

    Many small shards on two processes (:mod:`~deltarec.artifacts.shardpool`), large ones on
    ``READERS`` threads, else one by one here.
    """
    count = sum(len(g) for g in groups)
    if shardpool.can_pool(count, pub.root.is_local):
        return shardpool.read_groups(groups, read, True)
    jobs = [shard for group in groups for shard in group]
    got = iter(on_readers(read, jobs, sum(s.bytes for s in jobs)))
    return [[next(got) for _ in group] for group in groups]


def _rows(spec: TableSpec, parts: list[pa.Table]) -> ShardRows:
    """The rows of ``parts`` one after the other (none: an empty batch)."""
    if not parts:
        return ShardRows.empty(spec.dtype, spec.dim)
    try:
        return ShardRows.from_arrow(pa.concat_tables(parts), spec.dtype)
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # shards of other schemas (column order...)
        return ShardRows.concat([ShardRows.from_arrow(t, spec.dtype) for t in parts])
