"""Types shared by every table source of the dump engine (plain, sharded, ZCH).

A :class:`TableSource` stands for one tracked table's part on this rank. The dump engine asks
each source for the rows touched since the previous dump; the source answers with serving keys
(global row for plain tables, raw feature id or ``-1`` for ZCH tables), the rows' current
values read on the table's device, and an op per row. Sources never write artifacts.

The dumper calls one typed protocol on every source (:class:`TableSource`): ``configure`` and
``bind`` once, ``dump_collect`` / ``dump_snapshot`` / ``dump_read_keys`` at each dump (each
answers a :data:`Gathered`: host chunks this rank writes, or this rank's :class:`LocalParts` of
a table one writer rank assembles), ``before_eval`` / ``after_eval`` / ``discard`` / ``close``
at their moments. Every method has a default, so a source implements only what it does differently.
The tracking layer sits below the dumper and imports nothing from it.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias

import torch

from deltarec.artifacts.types import TableSpec
from deltarec.tracking.assemble import LocalParts
from deltarec.tracking.gather import HostRows, rows_to_host


@dataclass
class TouchedRows:
    """Rows to dump, still on the table's device.

    Attributes:
        keys: int64 ``[n]`` serving keys, unique within one result.
        rows: ``[n, dim]`` float values (the row for ``op == 0``; the fallback row for ``op == 1``).
        ops: int8 ``[n]``: 0 upsert, 1 evicted.
    """

    keys: torch.Tensor
    rows: torch.Tensor
    ops: torch.Tensor

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    @staticmethod
    def empty(dim: int, device: torch.device, dtype: torch.dtype = torch.float32) -> TouchedRows:
        """No rows."""
        return TouchedRows(
            keys=torch.empty(0, dtype=torch.int64, device=device),
            rows=torch.empty(0, dim, dtype=dtype, device=device),
            ops=torch.empty(0, dtype=torch.int8, device=device),
        )


@dataclass(frozen=True)
class SourceOptions:
    """Dumper settings that sources act on (handed to every source once, at start).

    Attributes:
        zch_misses: ZCH sources also dump the raw ids that training looked up but the table
            did not hold, each with ``op = 1`` and the fallback row the model answers them
            with (``DumperConfig.zch_misses``).
        device_graph_bytes: ``DumperConfig.device_graph_bytes``.
        spread_steps: ``DumperConfig.spread_steps``.
    """

    zch_misses: bool = False
    device_graph_bytes: int | None = 0
    spread_steps: int | None = None


class RankGroup(Protocol):
    """What a source learns of the dumper's process group: this process's rank."""

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        ...


Gathered: TypeAlias = "Iterator[HostRows] | LocalParts"
"""What a source answers at a dump: host chunks of the rows this rank writes (chunks may be a
:class:`~deltarec.tracking.gather.DeviceRows` staging buffer), or this rank's local part of a
table that one writer rank assembles from every rank's part."""


class TableSource(abc.ABC):
    """One tracked table's part on this rank: the protocol the dumper calls.

    Attributes:
        table_id: the table id (owning module FQN + ``.`` + table name, SPEC §3).
        spec: the table's description for GENERATION.json (global, identical on every rank).
        writes: whether this rank writes rows of this table (False e.g. for data-parallel
            replicas on ranks other than 0, or for table-wise tables on other ranks).
    """

    table_id: str
    spec: TableSpec
    writes: bool = True

    @abc.abstractmethod
    def collect(self) -> TouchedRows:
        """Rows touched since the previous ``collect`` (or since tracking began), read now.

        Called on the training thread between steps; must not run a collective operation
        unless the source documents that it does so only at dump time (column-wise).
        """

    @abc.abstractmethod
    def snapshot(self, chunk_rows: int) -> Iterator[TouchedRows]:
        """Every live row of this rank's part, in chunks of at most ``chunk_rows``."""

    @abc.abstractmethod
    def read_keys(self, keys: torch.Tensor) -> TouchedRows:
        """Current values of the given serving keys that this rank owns (restore republish).

        Keys that this rank does not own are left out. For ZCH tables a key that is no longer
        held comes back with ``op == 1`` and the fallback row.
        """

    # ---- what the dumper calls -----------------------------------------------------------
    def dump_collect(self, chunk_rows: int) -> Gathered:
        """The rows touched since the previous dump, at most ``chunk_rows`` per host chunk."""
        return _split(self.collect(), chunk_rows)

    def dump_snapshot(self, chunk_rows: int) -> Gathered:
        """Every row this rank writes (or its part of them), for a snapshot dump."""
        return (c for touched in self.snapshot(chunk_rows) for c in _split(touched, chunk_rows))

    def dump_read_keys(self, keys: torch.Tensor, chunk_rows: int) -> Gathered:
        """The current rows of the given serving keys this rank writes (restore republish)."""
        return _split(self.read_keys(keys), chunk_rows)

    def prepare_collect(self) -> None:  # noqa: B027 - optional hook
        """Queue device work for the next :meth:`dump_collect` without waiting for it.

        Called by the default :meth:`prepare_collects`, for each source alone.
        """

    @classmethod
    def prepare_collects(cls, sources: Sequence[TableSource]) -> None:
        """Queue device work for the next :meth:`dump_collect` of several sources at once.

        The dumper calls it (:func:`prepare_collects`) before it collects any source, once per
        dump for each class that defines it, with every source of that class, so that device
        sources can share their device calls and one host synchronization per dump. The
        default prepares each source alone (:meth:`prepare_collect`).
        """
        for source in sources:
            source.prepare_collect()

    @classmethod  # noqa: B027 - optional hook
    def absorb_recorded(cls, sources: Sequence[TableSource]) -> None:
        """Fold the lookups recorded so far into the next dump's state, without waiting.

        Optional: the dumper calls it (:func:`absorb_recorded`) every
        :data:`ABSORB_STEPS` training steps between dumps (never during evaluation), once
        per class that defines it, with every source of that class, so that work a dump of
        many steps would do at its step (marking recorded ids) is spread over the steps. The
        default does nothing: the dump takes everything.
        """

    def configure(self, options: SourceOptions) -> None:  # noqa: B027 - optional hook
        """Take the dumper's settings for sources (every rank, at start, before ``bind``)."""

    def bind(self, group: RankGroup) -> None:  # noqa: B027 - optional hook
        """Learn this process's rank in the dumper's group (every rank binds, at start)."""

    def before_eval(self) -> None:  # noqa: B027 - optional hook
        """Lookups from now on are evaluation, not training updates."""

    def after_eval(self) -> None:  # noqa: B027 - optional hook
        """Evaluation ended: forget what was recorded during it."""

    def discard(self) -> None:  # noqa: B027 - optional hook
        """Forget every touched id recorded so far (a generation starts from a full dump)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release hooks or buffers installed by the source."""


ABSORB_STEPS = 16
"""Training steps between the dumper's :func:`absorb_recorded` calls (between dumps).

A call costs a CUDA group of tables about two calls per table (tens of µs on the training
thread: ~0.2 % of a 2 ms step spread over 16 steps); a dump is left at most this many steps
of lookups to mark itself."""


def _owners(
    sources: Sequence[TableSource], method: str
) -> dict[type[TableSource], list[TableSource]]:
    """The classes that define ``method`` (first in each source's MRO), with their sources."""
    kinds: dict[type[TableSource], list[TableSource]] = {}
    for source in sources:
        owner = next(c for c in type(source).__mro__ if method in c.__dict__)
        kinds.setdefault(owner, []).append(source)
    return kinds


def absorb_recorded(sources: Sequence[TableSource]) -> None:
    """Let every source fold its recorded lookups in now (the dumper, between dumps).

    One :meth:`TableSource.absorb_recorded` call per class that overrides it.
    """
    for owner, group in _owners(sources, "absorb_recorded").items():
        if owner is not TableSource:
            owner.absorb_recorded(group)


def prepare_collects(sources: Sequence[TableSource]) -> None:
    """Prepare every source's next collection (what the dumper calls at each delta dump).

    One :meth:`TableSource.prepare_collects` call per class that defines it, with that class's
    sources in their order.
    """
    for owner, group in _owners(sources, "prepare_collects").items():
        owner.prepare_collects(group)


def _split(touched: TouchedRows, chunk_rows: int) -> Iterator[HostRows]:
    """Host chunks of at most ``chunk_rows`` rows of ``touched``."""
    n = len(touched)
    for start in range(0, n, chunk_rows):
        end = start + chunk_rows
        yield rows_to_host(touched.keys[start:end], touched.rows[start:end], touched.ops[start:end])
