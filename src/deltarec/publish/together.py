"""Several ranks' parts of one dump written together: one transaction per table (SQLite).

``deltarec publish`` publishes every rank's part of a dump from the artifacts. Part after part,
SQLite inserts each rank's keys between those of the ranks before it: with keys spread over
the ranks (random ids, or hashed sharding) every B-tree page is split and written again by
each part. :func:`publish_parts_together` writes all pending parts of a table in one
transaction instead (:meth:`~deltarec.stores.Store.write_parts`), rows in one key-ordered
pass and every part's progress mark in it, when

* the store writes parts together (``capabilities.parts_together``: SQLite), two or more
  ranks' parts are pending and none of them was started (no progress mark: a part cut short
  resumes on its own, after its mark);
* the parts of each table fit one transaction together (``batch_bytes``), so memory is bounded
  as for one part.

The rules of :meth:`~deltarec.publish.publisher.DumpPublisher.publish_dump` hold: every row is
checked before anything is applied (the first table's rows while they are written, the other
tables' in a first pass), each shard's sha256 is checked before its rows are used, a snapshot
is completed once every part is in, and each part gets its own result and freshness record.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from deltarec.artifacts import codec
from deltarec.artifacts.shards import ShardRows
from deltarec.artifacts.types import DumpKind, Manifest, TableSpec
from deltarec.errors import BadInputError
from deltarec.faults import failpoint
from deltarec.publish.heldparts import read_parts
from deltarec.publish.parts import part_rows, tables_left
from deltarec.publish.rows import TablePart, read_ahead
from deltarec.publish.types import PartResult, PublishMode
from deltarec.stores.types import ProgressMark, RowBatch

if TYPE_CHECKING:
    from deltarec.publish.face import PublisherFace


def publish_parts_together(
    pub: PublisherFace, manifest: Manifest, ranks: list[int]
) -> list[PartResult] | None:
    """Publish ``ranks``' parts of ``manifest`` table by table, or None if they cannot go together.

    See the module docstring for when they can; None leaves everything to part-by-part
    publishing (nothing was written).

    Raises:
        InvalidRowError: a row cannot be published (nothing of the parts was written).
        StoreUnavailableError: the store stayed unreachable past the retry deadline.
    """
    if not pub.store.capabilities.parts_together or len(ranks) < 2:
        return None
    if manifest.run != pub.run:
        raise BadInputError(f"manifest of run {manifest.run!r} given to run {pub.run!r}")
    start = time.monotonic()
    g, s = manifest.generation, manifest.seq
    pub.prepare(g)
    marks = pub.call(lambda: pub.registry.progress(pub.run, g), f"read progress of {g}")
    assert isinstance(marks, list)
    if any(m.seq == s and m.rank in ranks for m in marks):
        return None  # a part was started: each resumes after its own mark
    info = pub.generation_info(g)

    results = {rank: PartResult(g, s, rank) for rank in ranks}
    tables: list[tuple[str, TableSpec]] = []
    for rank in ranks:
        tables = tables_left(manifest, info, {}, results[rank])
    for table, spec in tables:
        if sum(part_rows(manifest, r, table) for r in ranks) > pub.transaction_rows(spec):
            return None
    pub.fence(g)  # one writer per run: never publish a superseded generation
    held = read_parts(pub, manifest, ranks, tables)  # small parts: read once, all checked
    where = f"run {pub.run!r} generation {g} dump {s} rank"
    for table, spec in tables[1:] if held is None else ():  # the first: checked while written
        for rank in ranks:
            pub.check_part(TablePart(pub.root, manifest, rank, table, spec), f"{where} {rank}")
    for table, spec in tables:
        rows = None if held is None else held.pop(table)
        _write_table(pub, manifest, ranks, table, spec, table == tables[0][0], rows)
        nbytes = codec.row_bytes(spec.dtype, spec.dim)
        counts = [part_rows(manifest, rank, table) for rank in ranks]
        for rank, n in zip(ranks, counts, strict=True):
            results[rank].rows += n
            results[rank].bytes += n * nbytes
            if pub.after_batch is not None:
                pub.after_batch(_mark(pub, manifest, table, rank, n), n)
        # the table's counters once for all its parts (hundreds of ranks: a label look-up each)
        pub.metrics.rows.labels(table, pub.mode.value).inc(sum(counts))
        pub.metrics.bytes.labels(table, pub.mode.value).inc(sum(counts) * nbytes)
    if manifest.kind is DumpKind.SNAPSHOT:
        pub.complete_snapshot(manifest)
    seconds = time.monotonic() - start
    for rank in ranks:
        pub.record_freshness(manifest, rank, results[rank])
        results[rank].seconds = seconds
        pub.metrics.dumps.labels(pub.mode.value).inc()
    pub.metrics.version.set(manifest.version)
    return [results[rank] for rank in ranks]


def _mark(pub: PublisherFace, manifest: Manifest, table: str, rank: int, rows: int) -> ProgressMark:
    """The complete mark of one rank's part of ``table``."""
    stage = manifest.generation if pub.mode is PublishMode.STAGED else 0
    return ProgressMark(pub.run, manifest.generation, manifest.seq, table, rank, rows, True, stage)


def _held_batches(held: list[ShardRows], version: int, spec: TableSpec) -> Iterator[RowBatch]:
    """``held`` rows as one batch, in rank order.

    The store sorts it once, a key in two parts applied as part after part would; empty if
    none (the parts still get their marks).
    """
    rows = [r for r in held if len(r)]
    r = ShardRows.concat(rows) if rows else ShardRows.empty(spec.dtype, spec.dim)
    yield RowBatch(r.keys, r.embedding, r.ops, np.full(len(r), version, np.int64))


def _write_table(
    pub: PublisherFace,
    manifest: Manifest,
    ranks: list[int],
    table: str,
    spec: TableSpec,
    check: bool,
    held: list[ShardRows] | None = None,
) -> None:
    """One transaction: every rank's rows of ``table`` (``check``: checked as read) and marks.

    ``held``: the rows, read and checked already (:mod:`deltarec.publish.heldparts`).
    """
    store = pub.store
    stage = manifest.generation if pub.mode is PublishMode.STAGED else None
    marks = [_mark(pub, manifest, table, r, part_rows(manifest, r, table)) for r in ranks]

    def batches() -> Iterator[RowBatch]:
        if held is not None:
            yield from _held_batches(held, manifest.version, spec)
            return
        where = f"run {pub.run!r} generation {manifest.generation} dump {manifest.seq} rank"
        sent = False
        # Every rank's reader starts now: the next rank's sha256 and first chunks are read
        # while the store applies this one's rows (at most two chunks ahead each).
        # In one transaction, a shard's sha256 can be checked after its rows are read, while the
        # store applies them; the store waits for it before it commits (a bad shard: nothing is
        # committed). Rows are checked as read, on the readers' threads (a bad row raises where
        # its chunk would come).
        size = pub.transaction_rows(spec)
        readers = [
            read_ahead(
                TablePart(pub.root, manifest, rank, table, spec),
                0,
                size,
                check,
                later,
                f"{where} {rank}" if check else None,
            )
            for rank in ranks
        ]
        try:
            for reader in readers:
                for rows in reader:
                    versions = np.full(len(rows), manifest.version, np.int64)
                    sent = True
                    yield RowBatch(rows.keys, rows.embedding, rows.ops, versions)
        finally:
            for reader in readers:
                reader.close()
        if not sent:  # parts without rows still get their marks
            empty = ShardRows.empty(spec.dtype, spec.dim)
            yield RowBatch(empty.keys, empty.embedding, empty.ops, np.empty(0, np.int64))

    def write() -> int:
        later.clear()  # a retry reads (and checks) the shards again
        return store.write_parts(table, batches(), marks, stage, before_commit=checked)

    def checked() -> None:
        for wait in later:
            wait()

    later: list[Callable[[], None]] = []
    pub.call(
        write,
        f"write the parts of ranks {ranks} of {table!r} (generation {manifest.generation} "
        f"dump {manifest.seq})",
    )
    failpoint("publish.batch")
