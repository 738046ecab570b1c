"""What is left of a dump's parts and how a part is split into transactions and read chunks.

A *part* is one rank's rows of one table of a committed dump. The publisher writes a part in
transactions of about ``batch_bytes`` of rows (never more than :data:`MAX_TRANSACTION_ROWS`),
each with its progress mark, and reads it in chunks of :data:`READ_BYTES`. A part whose mark
is complete is skipped; a part with an incomplete mark resumes after it.
"""

from __future__ import annotations

from collections.abc import Mapping

from deltarec.artifacts import codec
from deltarec.artifacts.shards import ShardRows
from deltarec.artifacts.types import GenerationInfo, Manifest, TableSpec
from deltarec.errors import BadInputError
from deltarec.publish.types import PartResult
from deltarec.stores.base import Store
from deltarec.stores.types import ProgressMark

READ_BYTES = 8 << 20
"""Rows read from the artifacts (and handed to the store) at a time."""

MAX_TRANSACTION_ROWS = 2 << 20
"""Rows per store transaction at most, whatever ``batch_bytes`` says: a transaction's per-row
state (SQLite's key-order spill index, 16 bytes a row) stays within 32 MB for narrow rows too."""
_PER_ROW_OVERHEAD = 24  # key, version, op and per-row store overhead, for batch sizing


def default_batch_bytes(store: Store) -> int:
    """The default bytes per transaction for ``store``: its ``capabilities.batch_bytes``.

    A transaction is also the unit of the progress marks: a crash loses at most one. Rows reach
    the store in read chunks of :data:`READ_BYTES` however large a transaction is, so memory
    does not grow with it.
    """
    return store.capabilities.batch_bytes


def rows_in(nbytes: int, spec: TableSpec) -> int:
    """How many rows of ``spec`` make about ``nbytes`` (at least one)."""
    return max(1, nbytes // (codec.row_bytes(spec.dtype, spec.dim) + _PER_ROW_OVERHEAD))


def transaction_rows(batch_bytes: int, spec: TableSpec) -> int:
    """Rows per store transaction: ``batch_bytes`` of rows, at most MAX_TRANSACTION_ROWS."""
    return min(rows_in(batch_bytes, spec), MAX_TRANSACTION_ROWS)


def read_rows(spec: TableSpec) -> int:
    """Rows per read chunk (:data:`READ_BYTES` of rows)."""
    return rows_in(READ_BYTES, spec)


def part_rows(
    manifest: Manifest, rank: int, table: str, memory: Mapping[str, ShardRows] | None = None
) -> int:
    """Rows of rank ``rank``'s part of ``table``: in ``memory`` if there, else its shards'."""
    if memory is not None and table in memory:
        return len(memory[table])
    return manifest.part_rows(table, rank)


def marks_of_part(marks: list[ProgressMark], seq: int, rank: int) -> dict[str, ProgressMark]:
    """Table id -> the mark of dump ``seq``'s part of rank ``rank``, among a generation's."""
    return {m.table: m for m in marks if m.seq == seq and m.rank == rank}


def tables_left(
    manifest: Manifest,
    info: GenerationInfo,
    done: Mapping[str, ProgressMark],
    result: PartResult,
) -> list[tuple[str, TableSpec]]:
    """The tables of a part left to write, in table order, given its marks ``done``.

    A complete mark skips its table, an incomplete one leaves it to resume; both add their rows
    to ``result.skipped_rows``. Every table written is appended to ``result.tables``.

    Raises:
        BadInputError: the manifest lists a table GENERATION.json does not declare.
    """
    todo = []
    for table in sorted(manifest.tables):
        spec = info.tables.get(table)
        if spec is None:
            raise BadInputError(
                f"dump {manifest.seq} of generation {manifest.generation} lists table "
                f"{table!r}, which GENERATION.json does not declare"
            )
        mark = done.get(table)
        if mark is not None:
            result.skipped_rows += mark.rows
            if mark.complete:
                continue
        todo.append((table, spec))
        result.tables.append(table)
    return todo


__all__ = [
    "MAX_TRANSACTION_ROWS",
    "READ_BYTES",
    "default_batch_bytes",
    "marks_of_part",
    "part_rows",
    "read_rows",
    "rows_in",
    "tables_left",
    "transaction_rows",
]
