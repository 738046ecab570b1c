"""Table sources of plain (non-ZCH) tables, one class per way a table is laid out on ranks.

* :class:`RowShardSource`: table-wise, row-wise and table-row-wise. This rank holds at most one
  block of rows ``[row_offset, row_offset + rows)``; the tracker's local ids plus the offset
  are the serving keys. Ranks hold disjoint blocks, so every key is written by one rank.
* :class:`ReplicatedSource`: data-parallel. Every rank holds the whole table and sees only its
  own lookups: at dump time the touched ids are united across ranks (one all_gather) and rank 0
  alone writes the rows.
* :class:`ColumnShardSource`: column-wise. Each holder has some columns of every row and sees
  the same ids. At dump time the ids are united (all_gather), each holder gathers its columns
  and the slices are sent to one writer rank (gather), which assembles whole rows.

The exchanges of the last two run on the dumper's own gloo group, on the training thread, at
dump time only; every rank iterates the same chunks so the collectives pair up.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from deltarec.artifacts.types import TableSpec
from deltarec.dump.exchange import Exchange
from deltarec.dump.gather import HostRows, dedup_ids, gather_to_host
from deltarec.tracking.tracker import TrackerHub
from deltarec.tracking.types import TableSource, TouchedRows


class _TrackedSource(TableSource):
    """Common parts: the tracker hub, eval pause, the materialized ABC methods."""

    def __init__(self, table_id: str, spec: TableSpec, hub: TrackerHub | None, fqn: str) -> None:
        self.table_id = table_id
        self.spec = spec
        self.hub = hub
        self.fqn = fqn

    def _take_ids(self, device: torch.device) -> torch.Tensor:
        """Touched local ids since the last call: sorted, unique, on ``device``."""
        ids = self.hub.take(self.fqn) if self.hub is not None else None
        if ids is None:
            return torch.empty(0, dtype=torch.int64, device=device)
        return ids.to(device=device, dtype=torch.int64)

    def before_eval(self) -> None:
        """Keep the ids training recorded so far; later ones are evaluation lookups."""
        if self.hub is not None:
            self.hub.hold()

    def after_eval(self) -> None:
        """Drop the ids recorded during evaluation."""
        if self.hub is not None:
            self.hub.drop_recorded()

    def discard(self) -> None:
        """Drop every id recorded so far (a generation starts from a snapshot or republish)."""
        if self.hub is not None:
            self.hub.discard_all()

    # Streaming variants, used by the dumper (they bound host memory).
    def iter_collect(self, chunk_rows: int) -> Iterator[HostRows]:
        """Touched rows since the previous call, as host chunks."""
        raise NotImplementedError

    def iter_snapshot(self, chunk_rows: int) -> Iterator[HostRows]:
        """Every row this rank writes, as host chunks."""
        raise NotImplementedError

    def iter_read_keys(self, keys: torch.Tensor, chunk_rows: int) -> Iterator[HostRows]:
        """Current rows of the given serving keys that this rank writes, as host chunks."""
        raise NotImplementedError

    # The TableSource ABC, materialized from the streams.
    def collect(self) -> TouchedRows:
        return _join(self.iter_collect(1 << 30), self.spec.dim)

    def snapshot(self, chunk_rows: int) -> Iterator[TouchedRows]:
        for host in self.iter_snapshot(chunk_rows):
            host.wait()
            yield TouchedRows(host.keys, host.rows, host.ops)

    def read_keys(self, keys: torch.Tensor) -> TouchedRows:
        return _join(self.iter_read_keys(keys, 1 << 30), self.spec.dim)


def _join(chunks: Iterator[HostRows], dim: int) -> TouchedRows:
    parts = list(chunks)
    for p in parts:
        p.wait()
    if not parts:
        return TouchedRows.empty(dim, torch.device("cpu"))
    return TouchedRows(
        keys=torch.cat([p.keys for p in parts]),
        rows=torch.cat([p.rows for p in parts]),
        ops=torch.cat([p.ops for p in parts]),
    )


class RowShardSource(_TrackedSource):
    """A table-wise, row-wise or table-row-wise table's block of rows on this rank.

    Args:
        table_id: the table id.
        spec: the table's spec.
        hub: where the touched local ids come from.
        fqn: the tracker FQN of the table.
        weight: this rank's ``[rows, dim]`` block (a view of the live parameters), or None
            if this rank holds no rows of the table.
        row_offset: global row of the block's first row.
    """

    def __init__(
        self,
        table_id: str,
        spec: TableSpec,
        hub: TrackerHub | None,
        fqn: str,
        weight: torch.Tensor | None,
        row_offset: int,
    ) -> None:
        super().__init__(table_id, spec, hub, fqn)
        self.weight = weight
        self.row_offset = int(row_offset)
        self.writes = weight is not None and weight.shape[0] > 0

    def iter_collect(self, chunk_rows: int) -> Iterator[HostRows]:  # noqa: D102
        if self.weight is None:
            if self.hub is not None:
                self.hub.take(self.fqn)
            return
        ids = self._take_ids(self.weight.device)
        yield from gather_to_host(self.weight, ids, chunk_rows, key_offset=self.row_offset)

    def iter_snapshot(self, chunk_rows: int) -> Iterator[HostRows]:  # noqa: D102
        if self.weight is None:
            return
        ids = torch.arange(self.weight.shape[0], dtype=torch.int64, device=self.weight.device)
        yield from gather_to_host(self.weight, ids, chunk_rows, key_offset=self.row_offset)

    def iter_read_keys(self, keys: torch.Tensor, chunk_rows: int) -> Iterator[HostRows]:  # noqa: D102
        if self.weight is None:
            return
        local = keys.to(self.weight.device, torch.int64) - self.row_offset
        local = local[(local >= 0) & (local < self.weight.shape[0])]
        yield from gather_to_host(self.weight, dedup_ids(local), chunk_rows, self.row_offset)


class ReplicatedSource(_TrackedSource):
    """A data-parallel table: every rank holds all rows; rank 0 writes the union of lookups.

    Args:
        exchange: the dumper's training-thread exchange (set by the dumper via
            :meth:`bind`; local when not distributed).
    """

    def __init__(
        self,
        table_id: str,
        spec: TableSpec,
        hub: TrackerHub | None,
        fqn: str,
        weight: torch.Tensor,
        exchange: Exchange | None = None,
    ) -> None:
        super().__init__(table_id, spec, hub, fqn)
        self.weight = weight
        self.exchange = exchange or Exchange(None)
        self.writes = self.exchange.rank == 0

    def bind(self, exchange: Exchange) -> None:
        """Use ``exchange`` for the dump-time union (every rank binds the same group)."""
        self.exchange = exchange
        self.writes = exchange.rank == 0

    def iter_collect(self, chunk_rows: int) -> Iterator[HostRows]:  # noqa: D102
        ids = self._take_ids(self.weight.device)
        everyone = self.exchange.all_gather(ids.cpu().numpy())
        if self.exchange.rank != 0:
            return
        union = torch.from_numpy(np.unique(np.concatenate(everyone))).to(self.weight.device)
        yield from gather_to_host(self.weight, union, chunk_rows)

    def iter_snapshot(self, chunk_rows: int) -> Iterator[HostRows]:  # noqa: D102
        if self.exchange.rank != 0:
            return
        ids = torch.arange(self.weight.shape[0], dtype=torch.int64, device=self.weight.device)
        yield from gather_to_host(self.weight, ids, chunk_rows)

    def iter_read_keys(self, keys: torch.Tensor, chunk_rows: int) -> Iterator[HostRows]:  # noqa: D102
        if self.exchange.rank != 0:
            return
        k = keys.to(self.weight.device, torch.int64)
        k = dedup_ids(k[(k >= 0) & (k < self.weight.shape[0])])
        yield from gather_to_host(self.weight, k, chunk_rows)


@dataclass
class ColumnShard:
    """Columns ``[col_offset, col_offset + tensor.shape[1])`` of every row, held here."""

    col_offset: int
    tensor: torch.Tensor


class ColumnShardSource(_TrackedSource):
    """A column-wise table: whole rows are assembled on one writer rank at dump time.

    Args:
        shards: this rank's column shards (empty if it holds none).
        writer_rank: the rank that writes the table (holder of the first columns).
        exchange: the dumper's training-thread exchange (see :meth:`bind`).
    """

    def __init__(
        self,
        table_id: str,
        spec: TableSpec,
        hub: TrackerHub | None,
        fqn: str,
        shards: list[ColumnShard],
        writer_rank: int,
        exchange: Exchange | None = None,
    ) -> None:
        super().__init__(table_id, spec, hub, fqn)
        self.shards = shards
        self.writer_rank = writer_rank
        self.exchange = exchange or Exchange(None)
        self.writes = self.exchange.rank == writer_rank

    def bind(self, exchange: Exchange) -> None:
        """Use ``exchange`` for the dump-time assembly (every rank binds the same group)."""
        self.exchange = exchange
        self.writes = exchange.rank == self.writer_rank

    def _device(self) -> torch.device:
        return self.shards[0].tensor.device if self.shards else torch.device("cpu")

    def iter_collect(self, chunk_rows: int) -> Iterator[HostRows]:  # noqa: D102
        mine = self._take_ids(self._device()).cpu().numpy() if self.shards else None
        if not self.shards and self.hub is not None:
            self.hub.take(self.fqn)
        everyone = self.exchange.all_gather(mine)
        parts = [p for p in everyone if p is not None]
        union = np.unique(np.concatenate(parts)) if parts else np.empty(0, np.int64)
        yield from self._assemble(union, chunk_rows)

    def iter_snapshot(self, chunk_rows: int) -> Iterator[HostRows]:  # noqa: D102
        yield from self._assemble(np.arange(self.spec.num_embeddings, dtype=np.int64), chunk_rows)

    def iter_read_keys(self, keys: torch.Tensor, chunk_rows: int) -> Iterator[HostRows]:  # noqa: D102
        k = keys.cpu().numpy().astype(np.int64)
        k = np.unique(k[(k >= 0) & (k < self.spec.num_embeddings)])
        yield from self._assemble(k, chunk_rows)

    def _assemble(self, ids: np.ndarray, chunk_rows: int) -> Iterator[HostRows]:
        """Same ``ids`` on every rank: one gather per chunk to the writer rank."""
        dev = self._device()
        for start in range(0, len(ids), chunk_rows):
            idx = ids[start : start + chunk_rows]
            t = torch.from_numpy(idx).to(dev)
            slices = [
                (s.col_offset, s.tensor.index_select(0, t).cpu().numpy()) for s in self.shards
            ]
            got = self.exchange.gather(slices, dst=self.writer_rank)
            if got is None:
                continue
            rows = np.empty((len(idx), self.spec.dim), dtype=np.float32)
            filled = 0
            for rank_slices in got:
                for col, values in rank_slices:
                    rows[:, col : col + values.shape[1]] = values
                    filled += values.shape[1]
            if filled != self.spec.dim:
                raise RuntimeError(
                    f"table {self.table_id}: column shards cover {filled} of {self.spec.dim} "
                    "columns"
                )
            yield HostRows(
                keys=torch.from_numpy(idx.copy()),
                rows=torch.from_numpy(rows),
                ops=torch.zeros(len(idx), dtype=torch.int8),
            )
