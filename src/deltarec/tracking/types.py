"""Types shared by every table source of the dump engine (plain, column-wise, ZCH).

A :class:`TableSource` stands for one tracked table's part on this rank. The dump engine asks
each source for the rows touched since the previous dump; the source answers with serving keys
(global row for plain tables, raw feature id or ``-1`` for ZCH tables), the rows' current
values read on the table's device, and an op per row. Sources never write artifacts.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from deltarec.artifacts.types import TableSpec


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


class TableSource(abc.ABC):
    """One tracked table's part on this rank.

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

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release hooks or buffers installed by the source."""
