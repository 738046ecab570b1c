"""Errors raised by ZCH (managed-collision) table tracking."""

from __future__ import annotations

from collections.abc import Sequence

from deltarec.errors import BadInputError, DeltarecError

_MAX_LISTED = 20


def _listed(values: Sequence[int]) -> str:
    shown = ", ".join(str(v) for v in values[:_MAX_LISTED])
    more = len(values) - _MAX_LISTED
    return f"[{shown}{f', ... {more} more' if more > 0 else ''}]"


class ZchError(DeltarecError):
    """Base class of ZCH tracking errors."""


class ZchRowRangeError(ZchError):
    """A managed-collision module produced rows outside this rank's shard of the table.

    Raised before the embedding lookup reads the rows, so no garbage values are trained on or
    dumped, and no device-side assert fires.

    Attributes:
        table: the table id.
        rows: the offending rows (global row numbers, as remapped), sorted, unique.
        low: first row of the local shard (inclusive).
        high: end of the local shard (exclusive).
    """

    def __init__(self, table: str, rows: Sequence[int], low: int, high: int, where: str) -> None:
        self.table = table
        self.rows = list(rows)
        self.low = low
        self.high = high
        super().__init__(
            f"ZCH table {table!r}: {where} produced {len(self.rows)} remapped row(s) outside "
            f"this rank's shard rows [{low}, {high}): {_listed(self.rows)}; the managed-collision "
            "state does not match the embedding shard (corrupted or mismatched checkpoint?)"
        )


class ZchTrackingError(ZchError):
    """The managed-collision module does not behave as the tracking expects.

    Raised e.g. when a module is already tracked by another open source, or when torchrec's
    ``MCHManagedCollisionModule`` internals differ from the supported torchrec version.
    """

    def __init__(self, table: str, problem: str) -> None:
        self.table = table
        super().__init__(f"ZCH table {table!r}: {problem}")


class ZchUnsupportedError(BadInputError):
    """A managed-collision table cannot be tracked (unsupported module type or sharding)."""

    def __init__(self, table: str, problem: str) -> None:
        self.table = table
        super().__init__(f"ZCH table {table!r}: {problem}")


class ZchKeyCollisionError(BadInputError):
    """A raw feature id equals the fallback key ``-1``, so it cannot be published as itself."""

    def __init__(self, table: str) -> None:
        self.table = table
        super().__init__(
            f"ZCH table {table!r}: raw feature id -1 is held by the managed-collision module, "
            "but -1 is the key of the shared fallback row; map raw ids to non-negative values"
        )
