"""Who serves a store: the run whose rows each table's serving name reads (SPEC §7).

Who serves is a fact of the store, not of a run: :meth:`~deltarec.stores.Registry.serving_runs`
names the run per table (the first run that provisioned a table, until another run is promoted
or rolled back), and each serving run's own pointer (:meth:`~deltarec.stores.Registry.
get_serving`) names the generation and dump it was last promoted or rolled back to. Every check
says which run it looked at with :meth:`Serving.describe`; a check of a run that does not serve
says so and names the run that does (:meth:`Serving.not_serving`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deltarec.stores.base import Store
from deltarec.stores.types import ServingPointer


@dataclass(frozen=True)
class Serving:
    """Who serves a store.

    Attributes:
        tables: table id -> the run its serving name reads.
        pointers: each serving run -> its current serving pointer (None: never promoted; it
            serves because it provisioned the table first).
    """

    tables: dict[str, str]
    pointers: dict[str, ServingPointer | None]

    @property
    def runs(self) -> list[str]:
        """The runs that serve at least one table, sorted."""
        return sorted(set(self.tables.values()))

    def serves(self, run: str) -> bool:
        """Whether ``run`` serves at least one table."""
        return run in self.tables.values()

    def tables_of(self, run: str) -> list[str]:
        """The tables ``run`` serves, sorted."""
        return sorted(t for t, r in self.tables.items() if r == run)

    def describe(self) -> str:
        """``run 'one' generation 3 dump 2`` per serving run, or ``no run serves``.

        Each run's tables are named when several runs serve (for messages and logs).
        """
        runs = self.runs
        if not runs:
            return "no run serves"
        parts = []
        for run in runs:
            p = self.pointers.get(run)
            where = f"generation {p.generation} dump {p.seq}" if p is not None else "never promoted"
            text = f"run {run!r} {where}"
            if len(runs) > 1:
                text += f" (tables {', '.join(self.tables_of(run))})"
            parts.append(text)
        return "; ".join(parts)

    def not_serving(self, run: str) -> str:
        """The line a check of ``run`` says when ``run`` serves no table."""
        return f"run {run!r} does not serve: serving is {self.describe()}"

    def to_json(self) -> dict[str, Any]:
        """``{"tables": {table: run}, "runs": {run: {"generation", "seq"} or None}}``."""
        return {
            "tables": dict(sorted(self.tables.items())),
            "runs": {
                run: None if p is None else {"generation": p.generation, "seq": p.seq}
                for run, p in sorted(self.pointers.items())
            },
        }


def who_serves(store: Store) -> Serving:
    """Who serves ``store`` now (read from its registry)."""
    registry = store.registry
    tables = registry.serving_runs()
    pointers = {run: registry.get_serving(run) for run in sorted(set(tables.values()))}
    return Serving(tables, pointers)


__all__ = ["Serving", "who_serves"]
