"""A backlog of small dumps published several at a time (SPEC §3a: costs follow the table).

After an outage a store may lack hundreds of small deltas. One transaction per dump, rank and
table costs each dump a commit, a progress mark and a round of reads; a backlog of 2,000-key
dumps then published at about a quarter of the rate of one dump of the same rows. Here
consecutive delta dumps that no store holds any part of are read together, each table's rows
are reduced to the newest row per key (each row keeps its own dump's version, so the versioned
upsert applies exactly what dump-by-dump publishing would leave), and written as one write per
table: into SQLite one key-ordered pass (rows of several versions share its statements) with
every dump's progress mark in the same transaction; into PostgreSQL and Redis one write with
the last dump's mark, the other dumps' marks recorded right after it (one transaction).

Shards are read on a few threads, each checked against its sha256 before its rows are used and
every row checked before anything is written. A crash between a write and the other marks
leaves those dumps pending: they are published again, which the versioned upsert makes
harmless. Snapshots are never grouped (publishing one removes the keys it lacks, which must
happen in order).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np

from deltarec.artifacts import codec
from deltarec.artifacts.shards import ShardRows, iter_shard
from deltarec.artifacts.types import DumpKind, Manifest, ShardInfo, TableSpec
from deltarec.artifacts.wholeshard import WHOLE_SHARD_BYTES, read_whole_shard
from deltarec.faults import failpoint
from deltarec.publish.heldparts import on_readers
from deltarec.publish.types import PartResult, PublishMode
from deltarec.stores.rows import check_batch
from deltarec.stores.types import ProgressMark, RowBatch

if TYPE_CHECKING:
    from deltarec.publish.face import PublisherFace

GROUP_ROWS = 1 << 20
"""The most rows (before the newest-per-key reduction) one group of dumps reads at once."""


def backlog_group(
    pub: PublisherFace,
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
    pub: PublisherFace,
    group: list[Manifest],
    on_part: Callable[[PartResult], None] | None,
) -> list[PartResult]:
    """Write ``group``'s rows table by table (newest row per key), with every dump's marks.

    Into a store that writes several marks with its rows (``parts_together``: SQLite) each
    table's rows and all of the group's marks of that table are one transaction. Elsewhere the
    rows go with the last dump's mark of rank 0, and the other marks follow: a crash between
    leaves those dumps without marks, to be published again (the versioned upsert keeps the
    newer rows).
    """
    t0 = time.perf_counter()
    last = group[-1]
    info = pub.generation_info(last.generation)
    stage = last.generation if pub.mode is PublishMode.STAGED else None
    together = pub.store.capabilities.parts_together
    rows_of: dict[tuple[int, int], int] = {}
    tables = sorted({t for m in group for t in m.tables})
    for table in tables:
        spec = info.tables[table]
        batch, per_rank = _newest_rows(pub, group, table, spec)
        for key, n in per_rank.items():
            rows_of[key] = rows_of.get(key, 0) + n
        marks = _marks(pub, group, table, stage or 0)
        what = f"dumps {group[0].seq}..{last.seq} of {table!r} (generation {last.generation})"
        if together:
            pub.call(
                lambda t=table, b=batch, k=marks: pub.store.write_parts(  # type: ignore[misc]
                    t, [b], k, staging_generation=stage
                ),
                f"write {what}",
            )
        else:
            pub.call(
                lambda t=table, b=batch, k=marks[-1]: pub.store.write_batches(  # type: ignore[misc]
                    t, [b], mark=k, staging_generation=stage
                ),
                f"write {what}",
            )
            pub.call(  # the other dumps' marks in one transaction
                lambda k=marks[:-1]: pub.registry.record_progress_many(k),  # type: ignore[misc]
                f"mark {what}",
            )
        failpoint("publish.batch")
        n = len(batch.keys)
        pub.metrics.rows.labels(table, pub.mode.value).inc(n)
        pub.metrics.bytes.labels(table, pub.mode.value).inc(
            n * codec.row_bytes(spec.dtype, spec.dim)
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


def _marks(pub: PublisherFace, group: list[Manifest], table: str, stage: int) -> list[ProgressMark]:
    """The complete marks of ``table`` for every dump and rank of ``group``.

    The last dump's mark of rank 0 comes last: a store that takes one mark commits it with the
    rows.
    """
    marks = []
    for m in group:
        if table not in m.tables:
            continue
        for rank in range(m.world_size):
            done = sum(s.rows for s in m.shards_of_rank(table, rank))
            marks.append(ProgressMark(pub.run, m.generation, m.seq, table, rank, done, True, stage))
    last = [k for k in marks if (k.seq, k.rank) == (group[-1].seq, 0)]
    return [k for k in marks if k not in last] + last


def _read_checked(
    pub: PublisherFace, m: Manifest, shard: ShardInfo, spec: TableSpec
) -> list[tuple[ShardRows, np.ndarray]]:
    """One shard's rows (its sha256 checked first), every chunk checked, with its versions."""
    dump_dir = pub.root.dump_dir(m.run, m.generation, m.seq)
    where = pub.root.url(dump_dir)
    if shard.bytes <= WHOLE_SHARD_BYTES:  # one open and one read: bytes checked, then decoded
        chunks: Iterable[ShardRows] = [read_whole_shard(pub.root, dump_dir, shard, spec.dtype)]
    else:
        chunks = iter_shard(pub.root, dump_dir, shard, spec.dtype, batch_rows=GROUP_ROWS)
    out = []
    for rows in chunks:
        v = np.full(len(rows), m.version, np.int64)
        args = (rows.keys, rows.embedding, rows.ops, v)
        check_batch(shard.table, spec.dtype, spec.dim, *args, where, spec.kind)
        out.append((rows, v))
    return out


def _newest_rows(
    pub: PublisherFace, group: list[Manifest], table: str, spec: TableSpec
) -> tuple[RowBatch, dict[tuple[int, int], int]]:
    """The newest row per key of ``table`` over ``group``, checked; rows read per (seq, rank).

    Shards are read on a few threads (:func:`~deltarec.publish.heldparts.on_readers`), their
    rows joined in dump order.
    """
    per_rank: dict[tuple[int, int], int] = {}
    jobs = [(m, shard) for m in group for shard in m.shards_of(table)]
    for m, shard in jobs:
        per_rank[(m.seq, shard.rank)] = per_rank.get((m.seq, shard.rank), 0) + shard.rows
    nbytes = sum(shard.bytes for _, shard in jobs)
    read = on_readers(lambda job: _read_checked(pub, job[0], job[1], spec), jobs, nbytes)
    chunks = [c for shard_chunks in read for c in shard_chunks]
    if not chunks:
        empty = ShardRows.empty(spec.dtype, spec.dim)
        return RowBatch(empty.keys, empty.embedding, empty.ops, np.empty(0, np.int64)), per_rank
    k = np.concatenate([rows.keys for rows, _ in chunks])
    order = np.argsort(k, kind="stable")  # dumps were read in version order: the last is newest
    ks = k[order]
    last = np.ones(len(ks), bool)
    last[:-1] = ks[1:] != ks[:-1]
    pick = order[last]
    batch = RowBatch(
        k[pick],
        np.concatenate([rows.embedding for rows, _ in chunks])[pick],
        np.concatenate([rows.ops for rows, _ in chunks])[pick],
        np.concatenate([v for _, v in chunks])[pick],
    )
    return batch, per_rank
