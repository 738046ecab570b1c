"""Tables that one writer rank assembles from every rank's part: column-wise and data-parallel.

On the training thread, at the dump step, each rank reads only its **local part** of such a
table (no collective there): a column-wise holder gathers its columns of the ids it touched, a
data-parallel replica gathers the rows of the ids it touched (every replica holds the same
values at that step). The parts go into the dump queue as :class:`Part` items; the background
worker exchanges them on its own gloo group and the writer rank assembles whole rows:

* :attr:`Mode.COLUMNS`: every holder saw the same ids, so part ``k`` of every holder has the
  same keys; their column slices are concatenated into whole rows.
* :attr:`Mode.UNION`: each replica saw its own lookups; the writer keeps the first row of each
  key (one row per key per dump, whatever the number of rounds).

A table's parts are exchanged in **rounds**, one gather to the writer per round. Before the
first round the ranks agree on the number of rounds (the most parts any rank has); a rank
with fewer parts sends nothing in the remaining rounds. Every rank sees the same tables in
the same order, so the collectives pair up.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from deltarec.tracking.gather import HostRows

Payload = tuple[np.ndarray, np.ndarray]
"""One rank's round of a table: ``(keys [n] int64, values [n, width])``."""


class Mode(str, enum.Enum):
    """How the writer rank assembles the parts of a table."""

    COLUMNS = "columns"
    UNION = "union"


@dataclass
class LocalParts:
    """This rank's part of a table, gathered on the training thread, assembled by the worker.

    Attributes:
        mode: how the writer assembles the parts.
        writer_rank: the rank that writes the table.
        columns: ``(column offset, width)`` of each block of the chunks' value columns, in
            order (``COLUMNS``; ``((0, dim),)`` for ``UNION``).
        count: the number of chunks ``chunks`` yields (known before gathering them).
        chunks: host chunks of at most ``chunk_rows`` rows each (keys ascending).
    """

    mode: Mode
    writer_rank: int
    columns: tuple[tuple[int, int], ...]
    count: int
    chunks: Iterator[HostRows]


@dataclass
class Part:
    """One queued chunk of a table's local part for dump ``seq`` (``rows`` None: no rows).

    Every rank queues at least one part per assembled table and dump (``index`` 0, with
    ``count`` 0 if it has no rows), so the worker always takes part in the table's rounds.
    """

    seq: int
    table: str
    step: int
    mode: Mode
    writer_rank: int
    columns: tuple[tuple[int, int], ...]
    index: int
    count: int
    rows: HostRows | None

    def payload(self) -> Payload | None:
        """``(keys, values)`` as numpy arrays (waits for the device→host copy)."""
        return None if self.rows is None else payload_of(self.rows)


def payload_of(host: HostRows) -> Payload:
    """``(keys, values)`` of a host chunk as numpy arrays (waits for the device→host copy)."""
    host.wait()
    keys, values, _ = host.numpy()
    return keys, values


def chunk_count(rows: int, chunk_rows: int) -> int:
    """How many chunks of at most ``chunk_rows`` hold ``rows`` rows."""
    return -(-rows // chunk_rows)


@dataclass
class Assembly:
    """The writer's state for one table of one dump: rounds done and keys already written.

    Args:
        table: the table id (for error messages).
        mode: how parts are put together.
        dim: the table's full width.
        rounds: the number of rounds the ranks agreed on.
    """

    table: str
    mode: Mode
    dim: int
    rounds: int
    done: int = 0
    seen: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))

    def assemble(
        self, got: Sequence[Payload | None], columns: Sequence[tuple[tuple[int, int], ...]]
    ) -> Payload | None:
        """Whole rows from one round of every rank's payload (in rank order), or None.

        Args:
            got: each rank's payload of this round (None: no rows this round).
            columns: each rank's column layout (only used in ``COLUMNS`` mode).

        Raises:
            RuntimeError: column holders sent different keys or do not cover every column.
        """
        if self.mode is Mode.COLUMNS:
            return self._columns(got, columns)
        return self._union([p for p in got if p is not None])

    def _columns(
        self, got: Sequence[Payload | None], columns: Sequence[tuple[tuple[int, int], ...]]
    ) -> Payload | None:
        present = [(r, p) for r, p in enumerate(got) if p is not None]
        if not present:
            return None
        keys = present[0][1][0]
        rows = np.empty((len(keys), self.dim), dtype=present[0][1][1].dtype)
        filled = 0
        for r, (k, values) in present:
            if not np.array_equal(k, keys):
                raise RuntimeError(
                    f"table {self.table}: column holders touched different ids (rank {r} sent "
                    f"{len(k)} keys, rank {present[0][0]} sent {len(keys)})"
                )
            at = 0
            for offset, width in columns[r]:
                rows[:, offset : offset + width] = values[:, at : at + width]
                at += width
                filled += width
        if filled != self.dim:
            raise RuntimeError(
                f"table {self.table}: column shards cover {filled} of {self.dim} columns"
            )
        return keys, rows

    def _union(self, parts: list[Payload]) -> Payload | None:
        if not parts:
            return None
        keys = np.concatenate([k for k, _ in parts]) if len(parts) > 1 else parts[0][0]
        keys, first = np.unique(keys, return_index=True)
        if self.seen.size:
            fresh = ~np.isin(keys, self.seen, assume_unique=True)
            keys, first = keys[fresh], first[fresh]
        if self.done + 1 < self.rounds:  # more rounds follow: remember what was written
            self.seen = np.union1d(self.seen, keys)
        values = np.concatenate([v for _, v in parts]) if len(parts) > 1 else parts[0][1]
        return keys, values[first]
