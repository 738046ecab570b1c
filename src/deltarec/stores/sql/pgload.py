"""How the rows of one PostgreSQL write reach the server: binary ``COPY``, straight in or staged.

Contract, inside the caller's transaction (see :meth:`PostgresStore.write_batches
<deltarec.stores.sql.postgres.PostgresStore.write_batches>`):

* :func:`sorted_rows` checks each batch (nothing is sent unless it passes) and sorts it by key;
* :func:`copy_rows` copies rows of keys the view does not hold yet straight into the view, in
  groups of up to :data:`_DIRECT_BYTES`, each in a savepoint; from the first group that holds
  a key the view already has, every row goes to the session's batch table
  (:data:`BATCH_TABLES`, ``ON COMMIT DELETE ROWS``), which the caller then merges with the
  version guard;
* :class:`Sent` tells the caller what went where (rows, deletes, rows in the batch table and
  whether they came in key order).

Rows are encoded for ``COPY`` by :mod:`deltarec.stores.sql.pgcopy`, a piece at a time.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from psycopg import errors as pgerrors

from deltarec.stores.naming import quote
from deltarec.stores.rows import ascending, checked_arrays
from deltarec.stores.sql.pgcopy import HEADER, TRAILER, batch_records
from deltarec.stores.types import RowBatch, ViewInfo

BATCH_TABLES = {"bytea": "deltarec_batch_bytea", "float4[]": "deltarec_batch_float4"}
"""The session's batch table per layout (``TEMP``, ``ON COMMIT DELETE ROWS``)."""
_COPY_CHUNK = 8 << 20
_DIRECT_BYTES = 32 << 20
"""Rows per ``COPY`` straight into a view, held until it is done (to be merged instead if a key
was there). One ``COPY`` per 8 MB read chunk ingested ~15 % slower than 32 MB groups here."""
_DIRECT_SAVEPOINTS = 48
"""At most this many groups of one write are copied straight into the view, each in its own
savepoint (a subtransaction). A backend keeps the ids of up to 64 subtransactions in shared
memory; past that, other sessions' snapshots look them up on disk while the write runs. The
publisher's transactions (up to 512 MB: 16 groups) stay well under this; the rest of a longer
write goes through the merge."""


class Rows(NamedTuple):
    """One batch, checked, with its keys, versions and ops sorted by key.

    ``order`` picks the embedding rows in that order (``None``: already in order); the rows
    themselves are picked a COPY piece at a time, so a large batch is not copied whole.
    """

    keys: np.ndarray
    embedding: np.ndarray
    versions: np.ndarray
    ops: np.ndarray
    order: np.ndarray | None

    def take(self, mask: np.ndarray) -> Rows:
        """The rows where ``mask`` is true."""
        if mask.all():
            return self
        order = np.flatnonzero(mask) if self.order is None else self.order[mask]
        return Rows(self.keys[mask], self.embedding, self.versions[mask], self.ops[mask], order)

    def embedding_rows(self, part: slice) -> np.ndarray:
        """The embedding rows of sorted positions ``part``."""
        if self.order is None:
            return self.embedding[part]
        return self.embedding[self.order[part]]


@dataclass
class Sent:
    """What one write has sent so far."""

    rows: int = 0
    deletes: bool = False
    staged: int = 0  # rows in the batch table
    in_order: bool = True  # the batch table's rows came in ascending key order
    last_staged: int | None = None


def sorted_rows(
    table: str, view: ViewInfo, batches: Iterable[RowBatch], sent: Sent
) -> Iterator[Rows]:
    """Each batch checked (nothing is sent unless it passes) and sorted by key."""
    for batch in batches:
        keys, ops, versions = checked_arrays(table, view, *batch)
        if not len(keys):
            continue
        sent.rows += len(keys)
        sent.deletes = sent.deletes or bool((ops == 1).any())
        if ascending(keys):
            yield Rows(keys, batch.embedding, versions, ops, None)
        else:
            order = np.argsort(keys)
            yield Rows(keys[order], batch.embedding, versions[order], ops[order], order)


def copy_rows(
    cur: Any,
    view: ViewInfo,
    layout: str,
    rows: Iterator[Rows],
    floor: int,
    direct: bool,
    sent: Sent,
) -> None:
    """Copy the batches' new rows into the view while that works, the rest to the batch table.

    With ``direct`` False (or past :data:`_DIRECT_SAVEPOINTS` groups) every row goes to the
    batch table. From the first group that holds a key the view already has, that group and
    every later batch go to the batch table in one ``COPY``.
    """
    for savepoints, first in enumerate(rows):
        if not direct or savepoints >= _DIRECT_SAVEPOINTS:
            _copy_batch(cur, layout, itertools.chain([first], rows), sent)
            return
        went_in, taken, left = copy_direct(cur, view, layout, first, rows, floor)
        if not went_in:
            _copy_batch(cur, layout, itertools.chain(taken, rows), sent)
            return
        if left:
            _copy_batch(cur, layout, iter(left), sent)


def copy_direct(
    cur: Any, view: ViewInfo, layout: str, first: Rows, rows: Iterator[Rows], floor: int
) -> tuple[bool, list[Rows], list[Rows]]:
    """Copy ``first`` and more of ``rows`` (:data:`_DIRECT_BYTES`) into the view itself.

    Returns whether they went in, the batches taken, and the rows of them that are not
    for the view directly: deletes in a live view (a staging view holds them as rows) and
    rows below the floor; those go to the merge.

    A binary ``COPY`` into the view writes its heap pages in bulk (one WAL record per
    page, not per row): rows go in about twice as fast as by a merge's inserts. It is
    right for keys the view does not hold: with no row and no tombstone (the caller does
    not come here when the view has tombstones) there is nothing to guard. The first key
    the view already has (or that another writer is inserting) fails it with a unique
    violation; the savepoint undoes the group, and the caller sends it to the merge.
    """
    with_op = bool(view.staging_generation)
    columns = "key, embedding, version, op" if with_op else "key, embedding, version"
    sql = f"COPY {quote(view.name)} ({columns}) FROM STDIN (FORMAT BINARY)"
    taken: list[Rows] = []
    left: list[Rows] = []
    try:
        with cur.connection.transaction(), cur.copy(sql) as cp:  # in a savepoint
            cp.write(HEADER)
            size = 0
            for batch in itertools.chain([first], rows):
                taken.append(batch)
                mine = batch.versions >= floor
                if not with_op:
                    mine &= batch.ops == 0
                _write_records(cp, batch.take(mine), with_op, layout)
                if not mine.all():
                    left.append(batch.take(~mine))
                size += len(batch.keys) * (batch.embedding[0].nbytes + 24)
                if size >= _DIRECT_BYTES:
                    break
            cp.write(TRAILER)
    except pgerrors.UniqueViolation:
        return False, taken, []
    return True, taken, left


def _copy_batch(cur: Any, layout: str, rows: Iterator[Rows], sent: Sent) -> None:
    """One ``COPY`` of every batch of ``rows`` into the batch table."""
    with cur.copy(
        f"COPY {BATCH_TABLES[layout]} (key, embedding, version, op) FROM STDIN (FORMAT BINARY)"
    ) as cp:
        cp.write(HEADER)
        for batch in rows:
            if not len(batch.keys):
                continue
            if sent.last_staged is not None and int(batch.keys[0]) <= sent.last_staged:
                sent.in_order = False
            sent.last_staged = int(batch.keys[-1])
            sent.staged += len(batch.keys)
            _write_records(cp, batch, True, layout)
        cp.write(TRAILER)


def _write_records(cp: Any, batch: Rows, with_op: bool, layout: str) -> None:
    """The COPY tuples of ``batch``, encoded about 8 MB at a time."""
    width = batch.embedding.shape[1] * batch.embedding.itemsize
    step = max(1, _COPY_CHUNK // (width + 40))
    for start in range(0, len(batch.keys), step):
        part = slice(start, start + step)
        records = batch_records(
            batch.keys[part],
            batch.embedding_rows(part),
            batch.versions[part],
            batch.ops[part] if with_op else None,
            layout,
        )
        cp.write(records.view(np.uint8).data)
