"""The CUDA tables of one device that dumps deduplicate together (and their buffers).

:class:`~deltarec.tracking.plain.RowShardSource` tables on one device form a
:class:`TableGroup`: one :class:`~deltarec.tracking.unique.UniqueBatch` bitmap for their
touched rows, the group's CUDA graphs (:mod:`deltarec.tracking.graphed`) and, with
``spread_steps``, its open spread dump (:mod:`deltarec.tracking.spread`). Tables on the CPU
form groups only for spread dumps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, TypeVar

import torch

from deltarec.tracking.device_budget import current_budget, current_ring
from deltarec.tracking.graphed import GraphedGather, default_set_bytes
from deltarec.tracking.spread import SpreadWindow, warm_up_spread
from deltarec.tracking.tracker import TrackerHub
from deltarec.tracking.types import TableSource
from deltarec.tracking.unique import BATCH_ROWS_MAX, UniqueBatch


class GroupMember(Protocol):
    """What a group needs of its tables (a :class:`~deltarec.tracking.plain.RowShardSource`)."""

    table_id: str
    fqn: str
    hub: TrackerHub | None
    weight: torch.Tensor | None
    row_offset: int
    graph_bytes: int | None
    spread_steps: int | None
    group: TableGroup | None


M = TypeVar("M", bound=GroupMember)


def batches(sources: Sequence[M]) -> list[list[M]]:
    """The sources that share a :class:`UniqueBatch`: by device, in order, within its rows."""
    out: list[list[M]] = []
    open_: dict[torch.device, tuple[list[M], list[int]]] = {}
    for s in sources:
        assert s.weight is not None
        group = open_.get(s.weight.device)
        rows = int(s.weight.shape[0])
        if group is None or group[1][0] + rows > BATCH_ROWS_MAX:
            group = open_[s.weight.device] = ([], [0])
            out.append(group[0])
        group[0].append(s)
        group[1][0] += rows
    return out


@dataclass
class TableGroup:
    """The CUDA tables of one device that a dump deduplicates together, and their buffers."""

    sources: list[GroupMember]
    batch: UniqueBatch
    graphs: GraphedGather | None

    @classmethod
    def of(cls, sources: Sequence[GroupMember]) -> TableGroup:
        """A group of ``sources``: their kernels loaded, their graphs captured (untimed).

        Graphed dumps are made where the sources were configured for them (by the dumper,
        :class:`~deltarec.tracking.types.SourceOptions`); a source used on its own takes the
        exact path.
        """
        weights = [s.weight for s in sources if s.weight is not None]
        device = weights[0].device
        batch = UniqueBatch([int(w.shape[0]) for w in weights], device)
        batch.warm_up(weights)
        limit = sources[0].graph_bytes if device.type == "cuda" else 0
        if limit is None:
            limit = default_set_bytes(device)
        graphs = None
        if limit > 0:
            graphs = GraphedGather(weights, [s.row_offset for s in sources], limit)
        if sources[0].spread_steps:
            warm_up_spread(weights, [s.row_offset for s in sources])
        group = cls(list(sources), batch, graphs)
        for s in sources:
            s.group = group
        return group

    def __post_init__(self) -> None:
        self.held: list[list[torch.Tensor]] = [[] for _ in self.sources]
        """Per member, id tensors taken from the hub and not yet marked (a graph may take them)."""
        self.held_ids = [0] * len(self.sources)
        self.window: SpreadWindow | None = None
        """The open spread dump of the group's tables (:mod:`deltarec.tracking.spread`)."""
        self._watching: bool | None = None
        self._counts: torch.Tensor | None = None  # the windows' pinned counts, reused

    def open_window(self, parts: list[list[torch.Tensor]], steps: int) -> SpreadWindow | None:
        """Take the dump's touched rows as a :class:`SpreadWindow`, read over ``steps`` steps.

        None where the group's lookups cannot be seen as they are recorded (the exact path
        is taken) or nothing was touched.
        """
        if self._watching is None:
            hubs = [s.hub for s in self.sources]
            self._watching = all(
                h is not None and h.watch(s.fqn, partial(self._on_lookup, i))
                for i, (s, h) in enumerate(zip(self.sources, hubs, strict=True))
            )
        if not self._watching:
            return None
        done = self.window
        if done is not None and done.completed:  # every flag of its bitmap is clear again
            self.batch.recycle()
        self.window = None
        recorded = [None if not p else p[0] if len(p) == 1 else torch.cat(p) for p in parts]
        pending = self.batch.take_marks(recorded)
        if pending is None:
            return None
        weights = [s.weight for s in self.sources if s.weight is not None]
        offsets = [s.row_offset for s in self.sources]
        budget, ring = current_budget(), current_ring()
        self.window = SpreadWindow(
            weights, offsets, pending, steps, budget, ring, host_counts=self._counts
        )
        self._counts = self.window.host_counts
        return self.window

    def _on_lookup(self, member: int, ids: torch.Tensor) -> None:
        window = self.window
        if window is not None and not window.closed:
            window.on_lookup(member, ids)

    def take(self, poll: bool = True) -> list[list[torch.Tensor]]:
        """Every member's recorded id tensors not yet marked in the bitmap, cleared here."""
        if poll:
            for hub in {id(s.hub): s.hub for s in self.sources if s.hub is not None}.values():
                hub.poll()
        parts = [s.hub.take_parts(s.fqn, poll=False) if s.hub else [] for s in self.sources]
        out = [held + new for held, new in zip(self.held, parts, strict=True)]
        self.held = [[] for _ in self.sources]
        self.held_ids = [0] * len(self.sources)
        return out

    def absorb(self) -> None:
        """Mark what was recorded since the last call in the bitmap, unless a graph may take it.

        While every member's ids since the last dump fit the graphs' capacity they stay held
        (the dump may replay a graph on them); once one does not, the dump takes the exact
        path, and they are marked: one ``torch.cat`` and one ``index_fill_`` per member.
        """
        graphs = self.graphs
        cap = graphs.capacity if graphs is not None and graphs.sets else 0
        if cap and not any(self.batch.marked):  # a graph may still take them: count the ids
            before = [(len(h), n) for h, n in zip(self.held, self.held_ids, strict=True)]
            parts = self.take()
            counts = [
                n + sum(int(p.numel()) for p in got[k:])
                for (k, n), got in zip(before, parts, strict=True)
            ]
            if max(counts, default=0) <= cap:
                self.held, self.held_ids = parts, counts
                return
        else:  # marked already, or no graph: the count would decide nothing
            parts = self.take()
        for i, got in enumerate(parts):
            if got:
                self.batch.mark(i, got[0] if len(got) == 1 else torch.cat(got))

    def forget(self, source: GroupMember) -> None:
        """Drop what ``source`` recorded so far (held and marked)."""
        i = self.sources.index(source)
        self.held[i], self.held_ids[i] = [], 0
        self.batch.clear(i)
        if self.window is not None:  # a generation starts afresh: its rows are not wanted
            self.window.close()
            self.window = None

    def release(self, source: GroupMember) -> list[torch.Tensor]:
        """What ``source`` recorded so far, as id tensors, for the group that replaces this one.

        Its marks are read back from the bitmap (one wait; only when the sources change).
        """
        i = self.sources.index(source)
        out, self.held[i], self.held_ids[i] = self.held[i], [], 0
        if self.batch.marked[i]:
            out.append(self.batch.blocks[i].nonzero().view(-1))
            self.batch.clear(i)
        return out


def graph_metrics(sources: Sequence[TableSource]) -> dict[str, int]:
    """Counters of the sources' graphed dumps (:mod:`deltarec.tracking.graphed`).

    ``graphed``: dumps of a CUDA group that took its graph; ``graph_misses``: dumps that took
    the exact path instead; ``graph_bytes``: device bytes of the groups' buffer sets.
    """
    groups = _groups(sources)
    graphs = [g.graphs for g in groups if g.graphs is not None]
    return {
        "graphed": sum(g.runs for g in graphs),
        "graph_misses": sum(g.misses for g in graphs),
        "graph_bytes": sum(g.nbytes for g in graphs),
    }


def spread_windows(sources: Sequence[TableSource]) -> list[tuple[SpreadWindow, list[str]]]:
    """The open spread dumps of ``sources``' groups (``DumperConfig.spread_steps``).

    Each with its tables' ids by position, as the last
    :meth:`RowShardSource.prepare_collects` opened them.
    """
    groups = _groups(sources)
    return [
        (g.window, [s.table_id for s in g.sources])
        for g in groups
        if g.window is not None and not g.window.closed
    ]


def _groups(sources: Sequence[Any]) -> list[TableGroup]:
    """The groups ``sources`` belong to, each once (sources of other kinds have none)."""
    found = {id(g): g for s in sources if (g := getattr(s, "group", None)) is not None}
    return list(found.values())
