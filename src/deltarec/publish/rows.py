"""A part's rows, read and checked, from memory or from its shards.

:class:`TablePart` names one rank's rows of one table of a committed dump and where they are:
handed over by the dumper (``memory``) or in the artifacts. :func:`part_chunks` gives them in
bounded chunks, :func:`read_ahead` from the shards on a reading thread, :func:`check_part`
checks every row and keeps none, :func:`checked_while_written` names the part whose rows are
checked as they are written, and :class:`PartReader` reads a part forward once across its
transactions. Every check is :func:`~deltarec.stores.check_batch`, the one every store applies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.shards import ShardRows, iter_shard
from deltarec.artifacts.types import Manifest, TableSpec
from deltarec.publish.parts import part_rows, read_rows
from deltarec.readahead import ReadAhead
from deltarec.stores.rows import check_batch
from deltarec.stores.types import ProgressMark


@dataclass(frozen=True)
class TablePart:
    """Rank ``rank``'s rows of ``table`` in dump ``manifest``, in ``memory`` or under ``root``.

    Attributes:
        root: the artifact root holding the dump's shards.
        manifest: the dump's committed manifest.
        rank: the rank whose rows these are.
        table: the table id.
        spec: the table's spec (GENERATION.json).
        memory: the rank's rows by table id, when the dumper handed them over; a table not in
            it is read from the artifacts.
    """

    root: ArtifactRoot
    manifest: Manifest
    rank: int
    table: str
    spec: TableSpec
    memory: Mapping[str, ShardRows] | None = None

    @property
    def in_memory(self) -> bool:
        """Whether the rows come from memory (else from the shards)."""
        return self.memory is not None and self.table in self.memory

    @property
    def rows(self) -> int:
        """How many rows the part holds."""
        return part_rows(self.manifest, self.rank, self.table, self.memory)

    def check(self, batch: ShardRows, where: str) -> None:
        """Raise :class:`~deltarec.errors.InvalidRowError` unless ``batch`` can be written."""
        versions = np.full(len(batch), self.manifest.version, np.int64)
        args = (batch.keys, batch.embedding, batch.ops, versions)
        check_batch(self.table, self.spec.dtype, self.spec.dim, *args, where, self.spec.kind)


def part_chunks(
    part: TablePart,
    skip: int,
    transaction_rows: int,
    whole_writes: bool,
    verify: bool = False,
    memory_rows: int | None = None,
    check: str | None = None,
) -> Iterator[ShardRows]:
    """The part's rows in chunks, without the first ``skip`` rows.

    Rows in memory come as views (no copies) of ``memory_rows`` rows each (default: one
    transaction, ``transaction_rows``, for a store that applies a write whole, which sorts a
    transaction's rows at once; a read chunk for any other, which encodes and sends each batch
    whole, as it does the artifacts' read chunks); rows from the artifacts in read chunks.
    ``verify`` checks each shard's sha256 before reading it (the first pass does). ``check``
    (where the rows come from, for the message): every chunk is checked
    (:meth:`TablePart.check`) before it comes, those from the artifacts on the reading thread.
    """
    if part.memory is not None and part.table in part.memory:
        data = part.memory[part.table]
        size = memory_rows or transaction_rows
        if not whole_writes:
            size = min(size, read_rows(part.spec))
        chunks = (data.slice(start, start + size) for start in range(skip, len(data), size))
        yield from _checked(chunks, part, check)
        return
    reader = read_ahead(part, skip, transaction_rows, verify, check=check)
    try:
        yield from reader
    finally:
        reader.close()


def read_ahead(
    part: TablePart,
    skip: int,
    transaction_rows: int,
    verify: bool,
    later: list[Callable[[], None]] | None = None,
    check: str | None = None,
) -> ReadAhead[ShardRows]:
    """The part's rows from the artifacts, read ahead from now on (a thread).

    As :func:`part_chunks` without rows in memory, in chunks of a read chunk or a transaction,
    whichever is smaller; the caller closes it. ``later`` (with ``verify``): each shard's
    sha256 is checked after its rows are read, and its wait is appended to ``later`` (see
    :func:`~deltarec.artifacts.shards.iter_shard`): only for rows that all go into one
    transaction, committed after the waits. ``check``: every chunk is checked on the reading
    thread too (a bad row is raised where its chunk would have come).
    """
    size = min(read_rows(part.spec), transaction_rows)
    rows = _shard_rows(part, size, skip, verify, later)
    return ReadAhead(_checked(rows, part, check), name="publish-read")


def check_part(part: TablePart, transaction_rows: int, whole_writes: bool, where: str) -> None:
    """Check the part's rows (shard checksums, then every chunk), keep none.

    Rows in memory are checked in read chunks too, so the temporaries stay bounded.
    """
    chunk = read_rows(part.spec)
    for _ in part_chunks(part, 0, transaction_rows, whole_writes, True, chunk, where):
        pass  # each chunk is checked as it is read


def _shard_rows(
    part: TablePart,
    size: int,
    skip: int,
    verify: bool,
    later: list[Callable[[], None]] | None = None,
) -> Iterator[ShardRows]:
    """The part's rows from its shards, after the first ``skip``, in chunks of about ``size``.

    Runs on :func:`read_ahead`'s thread.
    """
    manifest = part.manifest
    dump_dir = part.root.dump_dir(manifest.run, manifest.generation, manifest.seq)
    for shard in manifest.shards_of_rank(part.table, part.rank):
        seen = 0
        for batch in iter_shard(
            part.root,
            dump_dir,
            shard,
            part.spec.dtype,
            batch_rows=size,
            verify=verify,
            bounded_memory=True,
            verify_later=later,
        ):
            n = len(batch)
            if seen + n <= skip:
                seen += n
                continue
            cut = max(0, skip - seen)
            seen += n
            yield batch.slice(cut, n) if cut else batch


def _checked(
    chunks: Iterator[ShardRows], part: TablePart, where: str | None
) -> Iterator[ShardRows]:
    """``chunks``, each checked by :meth:`TablePart.check` before it comes.

    ``where`` names the rows' origin in the message; None: the chunks come unchecked.
    """
    for batch in chunks:
        if where is not None:
            part.check(batch, where)
        yield batch


class PartReader:
    """One rank's rows of one table, read forward once across its transactions.

    :meth:`take` continues where the previous one stopped; after a write that failed part-way
    (its rows were read but not committed) it reopens the rows at the transaction's start.
    """

    def __init__(self, open_at: Callable[[int], Iterator[ShardRows]], empty: ShardRows) -> None:
        self._open_at = open_at
        self._empty = empty
        self._rows: Iterator[ShardRows] = iter(())
        self._position = -1
        self._carry: ShardRows | None = None

    def take(self, start: int, count: int) -> Iterator[ShardRows]:
        """Rows ``start .. start + count`` in chunks (one empty chunk when ``count`` is 0)."""
        if self._position != start:
            self._rows, self._position, self._carry = self._open_at(start), start, None
        left, sent = count, False
        while left > 0:
            chunk = self._carry if self._carry is not None else next(self._rows, None)
            self._carry = None
            if chunk is None:
                break
            if len(chunk) > left:
                chunk, self._carry = chunk.slice(0, left), chunk.slice(left, len(chunk))
            self._position += len(chunk)
            left -= len(chunk)
            sent = True
            yield chunk
        if not sent:
            yield self._empty


def checked_while_written(
    parts: Sequence[TablePart],
    done: Mapping[str, ProgressMark],
    whole_writes: bool,
    rows_per_transaction: Callable[[TableSpec], int],
) -> str | None:
    """The table whose rows are checked as they are written instead of read twice, if any.

    That is the first table written (``parts[0]``), when its rows come from the artifacts, what
    is left of its part goes in one transaction, and the store applies a transaction whole or
    not at all (``whole_writes``: the SQL stores): a bad row then aborts that transaction, and
    the other tables were checked before it began, so nothing of the part is applied either way.
    """
    if not parts or not whole_writes:
        return None
    first = parts[0]
    if first.in_memory:
        return None  # in memory the first pass reads nothing: keep it
    left = first.rows - (done[first.table].rows if first.table in done else 0)
    return first.table if left <= rows_per_transaction(first.spec) else None


__all__ = [
    "PartReader",
    "TablePart",
    "check_part",
    "checked_while_written",
    "part_chunks",
    "read_ahead",
]
