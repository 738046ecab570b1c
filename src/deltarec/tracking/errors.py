"""Errors raised by the tracking of plain (non-ZCH) tables' touched rows."""

from __future__ import annotations

from collections.abc import Sequence

from deltarec.errors import DeltarecError


class TrackingError(DeltarecError):
    """Touched rows could not be attributed to their tables; the dump stops rather than miss rows.

    Attributes:
        tables: the table ids concerned (as the user knows them, e.g. ``sparse.ebc.user_id``;
            empty when no known table is concerned).
        paths: the paths torchrec's delta tracker filed the lookups under (empty when the
            problem is not about tracker paths).
        problem: what went wrong and what to do.
    """

    def __init__(self, tables: Sequence[str], paths: Sequence[str], problem: str) -> None:
        self.tables = list(tables)
        self.paths = list(paths)
        self.problem = problem
        if len(self.tables) == 1:
            what = f"table {self.tables[0]!r}"
        elif self.tables:
            what = f"tables {self.tables}"
        else:
            what = "no known table"
        at = ""
        if len(self.paths) == 1:
            at = f" (tracker path {self.paths[0]!r})"
        elif self.paths:
            at = f" (tracker paths {self.paths})"
        super().__init__(f"{what}{at}: {problem}")
