"""A backlog of small dumps published several at a time (SPEC §3a: costs follow the table).

After an outage a store may lack hundreds of small deltas. One transaction per dump, rank and
table costs each dump a commit, a progress mark and a round of reads; a backlog of 2,000-key
dumps then published at about a quarter of the rate of one dump of the same rows. Here
consecutive delta dumps that no store holds any part of are read together, each table's rows
are reduced to the newest row per key (each row keeps its own dump's version, so the versioned
upsert applies exactly what dump-by-dump publishing would leave), written in one transaction
with the last dump's mark, and the other dumps' marks are recorded after it.

A crash between the rows and the other marks leaves those dumps pending: they are published
again, which the versioned upsert makes harmless. Snapshots are never grouped (publishing one
removes the keys it lacks, which must happen in order).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from deltarec.artifacts import codec
from deltarec.artifacts.shards import ShardRows, iter_shard
from deltarec.artifacts.types import DumpKind, Manifest
from deltarec.publish.types import PartResult, PublishMode
from deltarec.stores.rows import check_batch
from deltarec.stores.types import ProgressMark, RowBatch

if TYPE_CHECKING:
    from deltarec.publish.publisher import DumpPublisher

GROUP_ROWS = 1 << 20
"""The most rows (before the newest-per-key reduction) one group of dumps reads at once."""


def backlog_group(
    pub: DumpPublisher,
    generation: int,
    seqs: list[int],
    todo: set[tuple[int, int]],
    untouched: set[int],
) -> list[Manifest]:
    """The consecutive dumps from ``seqs[0]`` that go together (two or more), else ``[]``.

    A dump goes into a group if it is not a snapshot, no store mark of it exists (``untouched``)
    and every rank's part of it is pending.
    """
    group: list[Manifest] = []
    rows = 0
    for seq in seqs:
        if seq not in untouched:
            break
        m = pub.root.read_manifest(pub.run, generation, seq)
        if m.kind is DumpKind.SNAPSHOT or any((seq, r) not in todo for r in range(m.world_size)):
            break
        if group and rows + sum(m.tables.values()) > GROUP_ROWS:
            break
        group.append(m)
        rows += sum(m.tables.values())
    return group if len(group) > 1 else []


def publish_group(
    pub: DumpPublisher,
    group: list[Manifest],
    on_part: Callable[[PartResult], None] | None,
) -> list[PartResult]:
    """Write ``group``'s rows table by table (newest row per key), then every dump's marks."""
    t0 = time.perf_counter()
    last = group[-1]
    info = pub.generation_info(last.generation)
    stage = last.generation if pub.mode is PublishMode.STAGED else None
    rows_of: dict[tuple[int, int], int] = {}
    tables = sorted({t for m in group for t in m.tables})
    for table in tables:
        spec = info.tables[table]
        batch, per_rank = _newest_rows(pub, group, table, spec)
        for key, n in per_rank.items():
            rows_of[key] = rows_of.get(key, 0) + n
        own = sum(s.rows for s in last.shards_of(table) if s.rank == 0)
        mark = ProgressMark(pub.run, last.generation, last.seq, table, 0, own, True, stage or 0)
        pub._call(
            lambda t=table, b=batch, k=mark: pub.store.write_batches(  # type: ignore[misc]
                t, [b], mark=k, staging_generation=stage
            ),
            f"write dumps {group[0].seq}..{last.seq} of {table!r} (generation {last.generation})",
        )
        n = len(batch.keys)
        pub.metrics.rows.labels(table, pub.mode.value).inc(n)
        pub.metrics.bytes.labels(table, pub.mode.value).inc(
            n * codec.row_bytes(spec.dtype, spec.dim)
        )
    for m in group:
        for table in m.tables:
            for rank in range(m.world_size):
                if (m.seq, rank, table) == (last.seq, 0, table):
                    continue
                done = sum(s.rows for s in m.shards_of(table) if s.rank == rank)
                mark = ProgressMark(
                    pub.run, m.generation, m.seq, table, rank, done, True, stage or 0
                )
                pub._call(
                    lambda k=mark: pub.registry.record_progress(k),  # type: ignore[misc]
                    f"mark dump {m.seq} of {table!r} rank {rank}",
                )
    seconds = time.perf_counter() - t0
    results = []
    for m in group:
        for rank in range(m.world_size):
            rows = rows_of.get((m.seq, rank), 0)
            width = {t: codec.row_bytes(info.tables[t].dtype, info.tables[t].dim) for t in m.tables}
            nbytes = sum(s.rows * width[s.table] for s in m.shards if s.rank == rank)
            part = PartResult(
                m.generation, m.seq, rank, rows, nbytes, 0, sorted(m.tables), seconds / len(group)
            )
            results.append(part)
            if on_part is not None:
                on_part(part)
    return results


def _newest_rows(
    pub: DumpPublisher, group: list[Manifest], table: str, spec
) -> tuple[RowBatch, dict[tuple[int, int], int]]:
    """The newest row per key of ``table`` over ``group``, checked; rows read per (seq, rank)."""
    keys, embs, ops, versions = [], [], [], []
    per_rank: dict[tuple[int, int], int] = {}
    for m in group:
        dump_dir = pub.root.dump_dir(m.run, m.generation, m.seq)
        where = pub.root.url(dump_dir)
        for shard in m.shards_of(table):
            for rows in iter_shard(pub.root, dump_dir, shard, spec.dtype):
                v = np.full(len(rows), m.version, np.int64)
                check_batch(
                    table,
                    spec.dtype,
                    spec.dim,
                    rows.keys,
                    rows.embedding,
                    rows.ops,
                    v,
                    where,
                    spec.kind,
                )
                keys.append(rows.keys)
                embs.append(rows.embedding)
                ops.append(rows.ops)
                versions.append(v)
            per_rank[(m.seq, shard.rank)] = per_rank.get((m.seq, shard.rank), 0) + shard.rows
    if not keys:
        empty = ShardRows.empty(spec.dtype, spec.dim)
        return RowBatch(empty.keys, empty.embedding, empty.ops, np.empty(0, np.int64)), per_rank
    k = np.concatenate(keys)
    order = np.argsort(k, kind="stable")  # dumps were read in version order: the last is newest
    ks = k[order]
    last = np.ones(len(ks), bool)
    last[:-1] = ks[1:] != ks[:-1]
    pick = order[last]
    batch = RowBatch(
        k[pick],
        np.concatenate(embs)[pick],
        np.concatenate(ops)[pick],
        np.concatenate(versions)[pick],
    )
    return batch, per_rank
