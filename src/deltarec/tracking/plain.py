"""Table sources of plain (non-ZCH) tables, one class per way a table is laid out on ranks.

* :class:`RowShardSource`: table-wise, row-wise and table-row-wise. This rank holds at most one
  block of rows ``[row_offset, row_offset + rows)``; the tracker's local ids plus the offset
  are the serving keys. Ranks hold disjoint blocks, so every key is written by one rank.
* :class:`ReplicatedSource`: data-parallel. Every rank holds the whole table and sees only its
  own lookups: each rank gathers the rows of the ids it touched, and rank 0 writes the union.
* :class:`ColumnShardSource`: column-wise and table-column-wise. Each holder has some columns of
  every row and sees the same ids: each holder gathers its columns of them, one writer rank
  assembles whole rows.

The last two only gather their local part on the training thread (no collective there); the
dump worker exchanges the parts on its own gloo group and assembles them
(:mod:`deltarec.tracking.assemble`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from deltarec.artifacts.types import TableSpec
from deltarec.tracking.assemble import Assembly, LocalParts, Mode, chunk_count, payload_of
from deltarec.tracking.gather import (
    CountedRows,
    HostRows,
    dedup_ids,
    gather_to_host,
    rows_to_host,
)
from deltarec.tracking.groups import TableGroup, batches
from deltarec.tracking.tracker import TrackerHub
from deltarec.tracking.types import Gathered, RankGroup, SourceOptions, TableSource, TouchedRows
from deltarec.tracking.unique import BatchedIds


@dataclass(frozen=True)
class _Alone:
    """The rank group of a source used without the dumper's groups: rank 0."""

    rank: int = 0


_ALONE = _Alone()


class _TrackedSource(TableSource):
    """Common parts: the tracker hub, eval pause, the materialized ABC methods."""

    def __init__(self, table_id: str, spec: TableSpec, hub: TrackerHub | None, fqn: str) -> None:
        self.table_id = table_id
        self.spec = spec
        self.hub = hub
        self.fqn = fqn

    def _take_ids(self, device: torch.device, num_rows: int) -> torch.Tensor:
        """Touched local ids since the last call: sorted, unique, on ``device``."""
        ids = self.hub.take(self.fqn, num_rows) if self.hub is not None else None
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

    def close(self) -> None:
        """Remove the hub's lookup hooks (shared by the model's sources; idempotent)."""
        if self.hub is not None:
            self.hub.close()

    # Streaming variants, used by the dumper (they bound host memory).
    # The dumper's protocol: the streams.
    def dump_collect(self, chunk_rows: int) -> Gathered:
        return self.iter_collect(chunk_rows)

    def dump_snapshot(self, chunk_rows: int) -> Gathered:
        return self.iter_snapshot(chunk_rows)

    def dump_read_keys(self, keys: torch.Tensor, chunk_rows: int) -> Gathered:
        return self.iter_read_keys(keys, chunk_rows)

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


_SPREAD = object()
"""A source's prepared collection when its rows are read by its group's spread dump."""


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
        self._prepared: tuple[BatchedIds, int] | CountedRows | object | None = None
        self.group: TableGroup | None = None
        self.graph_bytes: int | None = 0
        self.spread_steps: int | None = None

    def configure(self, options: SourceOptions) -> None:
        """Take the dumper's settings for this table's group.

        ``options.device_graph_bytes``: the byte limit of the group's graphs;
        ``options.spread_steps``: read dumps over the steps after them (copy on write).
        """
        self.graph_bytes = options.device_graph_bytes
        self.spread_steps = options.spread_steps

    def iter_collect(self, chunk_rows: int) -> Iterator[HostRows]:  # noqa: D102
        if self.weight is None:
            if self.hub is not None:
                self.hub.take(self.fqn)
            return
        prepared, self._prepared = self._prepared, None
        if prepared is _SPREAD:
            return  # read over the next steps by the group's spread dump
        if isinstance(prepared, CountedRows):
            yield prepared  # gathered by the group's graph: the worker copies
            return
        if isinstance(prepared, tuple):
            ids = prepared[0].ids(prepared[1])
        else:
            ids = self._take_ids(self.weight.device, self.weight.shape[0])
        yield from gather_to_host(self.weight, ids, chunk_rows, key_offset=self.row_offset)

    def prepare_collect(self) -> None:
        """Queue this table's deduplication alone (see :meth:`prepare_collects`)."""
        type(self).prepare_collects([self])

    @classmethod
    def prepare_collects(cls, sources: Sequence[TableSource]) -> None:
        """Queue the deduplication of every CUDA table's touched ids, without waiting for it.

        The dumper calls this before it collects any table. The tables on one device form a
        group (kept from dump to dump while the same sources come). Where the group's CUDA
        graph holds the ids recorded and a set of its buffers is free, one replay deduplicates
        and gathers every table's rows (:mod:`deltarec.tracking.graphed`: nothing waits).
        Otherwise the group's :class:`UniqueBatch` queues the deduplication, and the first
        table's :meth:`iter_collect` waits once for every table (one host synchronization per
        dump). CPU tables, and a rank without rows, deduplicate in :meth:`iter_collect` as
        before.
        """
        batched: list[RowShardSource] = []
        for s in sources:
            assert isinstance(s, RowShardSource)
            s._drop_prepared()
            grouped = s.weight is not None and (s.weight.is_cuda or s.spread_steps)
            if grouped and s.hub is not None:
                batched.append(s)
        for members in batches(batched):
            group = members[0].group
            carried: list[list[torch.Tensor]] = [[] for _ in members]
            if group is None or group.sources != members:
                carried = [s.group.release(s) if s.group else [] for s in members]
                group = TableGroup.of(members)
            parts = [c + p for c, p in zip(carried, group.take(), strict=True)]
            graphs = group.graphs
            marked = any(group.batch.marked)
            graphed = graphs.try_run(parts) if graphs is not None and not marked else None
            if graphed is not None:
                for s, rows in zip(members, graphed, strict=True):
                    s._prepared = rows
                continue
            steps = members[0].spread_steps
            if steps and group.open_window(parts, steps) is not None:
                for s in members:
                    s._prepared = _SPREAD
                continue
            recorded = [None if not p else p[0] if len(p) == 1 else torch.cat(p) for p in parts]
            dump = group.batch.queue(recorded)
            for i, s in enumerate(members):
                s._prepared = (dump, i)

    def _drop_prepared(self) -> None:
        """Forget a prepared collection never taken (its graph buffers go back to the set)."""
        prepared, self._prepared = self._prepared, None
        if isinstance(prepared, CountedRows):
            prepared.release()  # graph buffers back to their set, staging bytes to the budget

    @classmethod
    def absorb_recorded(cls, sources: Sequence[TableSource]) -> None:
        """Mark the ids recorded since the last call in each CUDA group's bitmap, not waiting.

        The dumper calls this every few training steps between dumps
        (:data:`~deltarec.tracking.types.ABSORB_STEPS`), never during evaluation. A dump of
        many steps' lookups then has only the last few steps' ids to mark: the training
        thread's part of it no longer grows with the steps since the previous dump (before,
        about 3-4 µs per recorded lookup tensor, all at the dump step). Groups are those the
        last :meth:`prepare_collects` formed; sources without one wait for the dump.
        """
        groups = {id(g): g for s in sources if isinstance(s, RowShardSource) and (g := s.group)}
        for group in groups.values():
            group.absorb()

    def discard(self) -> None:  # noqa: D102
        self._drop_prepared()
        if self.group is not None:
            self.group.forget(self)
        super().discard()

    def close(self) -> None:  # noqa: D102
        self._drop_prepared()
        group, self.group = self.group, None
        if group is not None and group.graphs is not None:
            group.graphs.close()
        if self.hub is not None:  # no more copies on write once the dumper is gone
            self.hub.unwatch(self.fqn)
        super().close()

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
        ids = dedup_ids(local, self.weight.shape[0])
        yield from gather_to_host(self.weight, ids, chunk_rows, self.row_offset)


class AssembledSource(_TrackedSource):
    """A table whose whole rows one writer rank assembles from every rank's local part.

    The dumper's ``dump_*`` calls answer :class:`~deltarec.tracking.assemble.LocalParts`
    (``parts_collect``, ``parts_snapshot``, ``parts_read_keys``): this rank's rows or columns,
    gathered on the training thread without any collective; the dump worker exchanges and
    assembles them.
    The :class:`TableSource` methods assemble the local part alone, which gives whole rows
    only when this rank holds every column (one process).
    """

    mode: Mode
    writer_rank: int = 0
    rank: int = 0

    def bind(self, group: RankGroup) -> None:
        """Learn this rank's place in the dumper's groups (every rank binds the same group)."""
        self.rank = group.rank
        self.writes = self.rank == self.writer_rank

    def dump_collect(self, chunk_rows: int) -> Gathered:  # noqa: D102
        return self.parts_collect(chunk_rows)

    def dump_snapshot(self, chunk_rows: int) -> Gathered:  # noqa: D102
        return self.parts_snapshot(chunk_rows)

    def dump_read_keys(self, keys: torch.Tensor, chunk_rows: int) -> Gathered:  # noqa: D102
        return self.parts_read_keys(keys, chunk_rows)

    def parts_collect(self, chunk_rows: int) -> LocalParts:
        """This rank's part of the rows touched since the previous call."""
        raise NotImplementedError

    def parts_snapshot(self, chunk_rows: int) -> LocalParts:
        """This rank's part of every row of the table."""
        raise NotImplementedError

    def parts_read_keys(self, keys: torch.Tensor, chunk_rows: int) -> LocalParts:
        """This rank's part of the current rows of the given serving keys."""
        raise NotImplementedError

    def _alone(self, parts: LocalParts) -> Iterator[HostRows]:
        asm = Assembly(self.table_id, parts.mode, self.spec.dim, parts.count)
        for host in parts.chunks:
            whole = asm.assemble([payload_of(host)], [parts.columns])
            asm.done += 1
            if whole is not None:
                yield HostRows(
                    torch.from_numpy(whole[0]),
                    torch.from_numpy(whole[1]),
                    torch.zeros(len(whole[0]), dtype=torch.int8),
                )

    def iter_collect(self, chunk_rows: int) -> Iterator[HostRows]:  # noqa: D102
        yield from self._alone(self.parts_collect(chunk_rows))

    def iter_snapshot(self, chunk_rows: int) -> Iterator[HostRows]:  # noqa: D102
        yield from self._alone(self.parts_snapshot(chunk_rows))

    def iter_read_keys(self, keys: torch.Tensor, chunk_rows: int) -> Iterator[HostRows]:  # noqa: D102
        yield from self._alone(self.parts_read_keys(keys, chunk_rows))


class ReplicatedSource(AssembledSource):
    """A data-parallel table: every rank holds all rows; rank 0 writes the union of lookups.

    Each rank gathers the rows of the ids it touched (the replicas are equal at the dump
    step); the writer keeps one row per key. Snapshots and republished keys come from rank 0.

    Args:
        exchange: the dumper's exchange, for this rank's number (set by the dumper via
            :meth:`bind`; rank 0 when not distributed).
    """

    mode = Mode.UNION

    def __init__(
        self,
        table_id: str,
        spec: TableSpec,
        hub: TrackerHub | None,
        fqn: str,
        weight: torch.Tensor,
        exchange: RankGroup | None = None,
    ) -> None:
        super().__init__(table_id, spec, hub, fqn)
        self.weight = weight
        self.bind(exchange or _ALONE)

    def _parts(self, ids: torch.Tensor, chunk_rows: int) -> LocalParts:
        return LocalParts(
            self.mode,
            self.writer_rank,
            ((0, self.spec.dim),),
            chunk_count(int(ids.shape[0]), chunk_rows),
            gather_to_host(self.weight, ids, chunk_rows),
        )

    def parts_collect(self, chunk_rows: int) -> LocalParts:  # noqa: D102
        ids = self._take_ids(self.weight.device, self.weight.shape[0])
        return self._parts(ids, chunk_rows)

    def parts_snapshot(self, chunk_rows: int) -> LocalParts:  # noqa: D102
        n = self.weight.shape[0] if self.rank == self.writer_rank else 0
        ids = torch.arange(n, dtype=torch.int64, device=self.weight.device)
        return self._parts(ids, chunk_rows)

    def parts_read_keys(self, keys: torch.Tensor, chunk_rows: int) -> LocalParts:  # noqa: D102
        k = keys.to(self.weight.device, torch.int64)
        if self.rank != self.writer_rank:
            k = k[:0]
        k = dedup_ids(k[(k >= 0) & (k < self.weight.shape[0])], self.weight.shape[0])
        return self._parts(k, chunk_rows)


@dataclass
class ColumnShard:
    """Columns ``[col_offset, col_offset + tensor.shape[1])`` of every row, held here."""

    col_offset: int
    tensor: torch.Tensor


class ColumnShardSource(AssembledSource):
    """A column-wise or table-column-wise table: one writer rank assembles whole rows.

    Every holder of columns sees the same ids (the lookups reach every column shard), so
    chunk ``k`` of every holder has the same keys; each holder gathers its columns of them.

    Args:
        shards: this rank's column shards (empty if it holds none).
        writer_rank: the rank that writes the table (holder of the first columns).
        exchange: the dumper's exchange, for this rank's number (see :meth:`bind`).
    """

    mode = Mode.COLUMNS

    def __init__(
        self,
        table_id: str,
        spec: TableSpec,
        hub: TrackerHub | None,
        fqn: str,
        shards: list[ColumnShard],
        writer_rank: int,
        exchange: RankGroup | None = None,
    ) -> None:
        super().__init__(table_id, spec, hub, fqn)
        self.shards = shards
        self.writer_rank = writer_rank
        self.bind(exchange or _ALONE)

    def _device(self) -> torch.device:
        return self.shards[0].tensor.device if self.shards else torch.device("cpu")

    def parts_collect(self, chunk_rows: int) -> LocalParts:  # noqa: D102
        if not self.shards:
            if self.hub is not None:
                self.hub.take(self.fqn)
            return self._parts(torch.empty(0, dtype=torch.int64), chunk_rows)
        ids = self._take_ids(self._device(), self.spec.num_embeddings)
        return self._parts(ids, chunk_rows)

    def parts_snapshot(self, chunk_rows: int) -> LocalParts:  # noqa: D102
        n = self.spec.num_embeddings if self.shards else 0
        return self._parts(torch.arange(n, dtype=torch.int64, device=self._device()), chunk_rows)

    def parts_read_keys(self, keys: torch.Tensor, chunk_rows: int) -> LocalParts:  # noqa: D102
        k = keys.to(self._device(), torch.int64)
        if not self.shards:
            k = k[:0]
        k = dedup_ids(k[(k >= 0) & (k < self.spec.num_embeddings)], self.spec.num_embeddings)
        return self._parts(k, chunk_rows)

    def _parts(self, ids: torch.Tensor, chunk_rows: int) -> LocalParts:
        columns = tuple((s.col_offset, int(s.tensor.shape[1])) for s in self.shards)
        count = chunk_count(int(ids.shape[0]), chunk_rows) if self.shards else 0
        chunks = self._gather(ids, chunk_rows)
        return LocalParts(self.mode, self.writer_rank, columns, count, chunks)

    def _gather(self, ids: torch.Tensor, chunk_rows: int) -> Iterator[HostRows]:
        """This rank's columns of ``ids``, chunk by chunk, side by side in shard order."""
        for start in range(0, int(ids.shape[0]), chunk_rows):
            idx = ids[start : start + chunk_rows]
            parts = [s.tensor.index_select(0, idx) for s in self.shards]
            values = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
            yield rows_to_host(idx, values)
