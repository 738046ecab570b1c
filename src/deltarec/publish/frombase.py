"""Publishing from a compacted base (SPEC §3a): a store that is empty or behind starts there.

A store that holds nothing of a generation, or lacks a dump that retention has removed, is
brought to the base's point by writing the base's rows (each with the version of the dump that
wrote it; ``op = 1`` rows as version-guarded deletes), then only the dumps after the base are
published. The base's point is recorded with progress marks of its ``through_seq`` (one per
table and rank), so a later publish knows the store holds it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import pyarrow.parquet as pq

from deltarec.artifacts import codec
from deltarec.artifacts.base import BaseInfo, part_shard, usable_base
from deltarec.artifacts.lineage import cutoffs
from deltarec.artifacts.shards import ShardRows, check_shard
from deltarec.publish.types import PublishMode
from deltarec.stores.rows import check_batch
from deltarec.stores.types import ProgressMark, RowBatch

if TYPE_CHECKING:
    from deltarec.publish.face import PublisherFace

log = logging.getLogger(__name__)

BATCH_ROWS = 65536
"""Rows per batch read from a part (a table's part is written in one transaction)."""


def start_from_base(pub: PublisherFace, generation: int, ranks: list[int] | None) -> int:
    """Bring the store to the newest base of ``generation`` if it needs it.

    Returns:
        The base's ``through_seq`` if the store holds the base's point (already, or now):
        dumps at or below it need no publishing; ``-1`` if there is no base of the generation
        or the store follows the dumps themselves.
    """
    root, run = pub.root, pub.run
    base = usable_base(root, run, cutoffs(root, run, generation), None)
    if base is None or base.generation != generation:
        return -1
    world = pub.generation_info(generation).world_size
    marks = pub.registry.progress(run, generation)
    done = {(m.seq, m.table, m.rank) for m in marks if m.complete}
    through = base.through_seq
    if all((through, t, r) in done for t in base.tables for r in range(world)):
        return through
    held = {m.seq for m in marks if m.complete}
    existing = set(root.committed_seqs(run, generation))
    gone = [s for s in range(1, through + 1) if s not in existing and s not in held]
    if held and not gone:
        return -1  # behind by dumps the outbox still holds: they are published in order
    if ranks is not None and 0 not in ranks:
        return -1  # one publisher writes the base: the one of rank 0
    _publish_base(pub, base, world)
    return through


def _publish_base(pub: PublisherFace, base: BaseInfo, world: int) -> None:
    stage = base.generation if pub.mode is PublishMode.STAGED else None
    base_dir = pub.root.base_dir(base.run, base.generation, base.through_seq)
    for table, spec in sorted(base.tables.items()):
        for part in base.parts_of(table):
            check_shard(pub.root, base_dir, part_shard(part))  # sha256 before a row is written
        mark = ProgressMark(
            base.run, base.generation, base.through_seq, table, 0, base.rows.get(table, 0), True
        )
        batches = _batches(pub, base, table)
        pub.call(
            lambda t=table, b=batches, m=mark: pub.store.write_batches(  # type: ignore[misc]
                t, b, mark=m, staging_generation=stage
            ),
            f"write the base of {table!r} (generation {base.generation} through dump "
            f"{base.through_seq})",
        )
        for rank in range(1, world):
            other = ProgressMark(base.run, base.generation, base.through_seq, table, rank, 0, True)
            empty = ShardRows.empty(spec.dtype, spec.dim)
            none = RowBatch(empty.keys, empty.embedding, empty.ops, np.empty(0, np.int64))
            pub.call(
                lambda t=table, m=other, n=none: pub.store.write_batches(  # type: ignore[misc]
                    t, [n], mark=m, staging_generation=stage
                ),
                f"mark the base of {table!r} rank {rank}",
            )
    log.info(
        "store started from base %s: %d rows",
        base_dir,
        sum(base.rows.values()),
    )


def _batches(pub: PublisherFace, base: BaseInfo, table: str) -> Iterator[RowBatch]:
    """The rows of ``table``'s parts, checked, one batch at a time (at least one batch)."""
    spec = base.tables[table]
    base_dir = pub.root.base_dir(base.run, base.generation, base.through_seq)
    sent = False
    for part in base.parts_of(table):
        where = pub.root.url(f"{base_dir}/{part.path}")
        with pub.root.open_listed(base_dir, part.path) as f:
            reader = pq.ParquetFile(f)
            for batch in reader.iter_batches(batch_size=BATCH_ROWS):
                rows = ShardRows.from_arrow(batch, spec.dtype)
                versions = np.asarray(batch.column(codec.VERSION).to_numpy(), np.int64)
                args = (rows.keys, rows.embedding, rows.ops, versions)
                check_batch(table, spec.dtype, spec.dim, *args, where, spec.kind)
                sent = True
                yield RowBatch(*args)
    if not sent:
        empty = ShardRows.empty(spec.dtype, spec.dim)
        yield RowBatch(empty.keys, empty.embedding, empty.ops, np.empty(0, np.int64))
