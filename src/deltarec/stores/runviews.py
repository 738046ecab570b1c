"""Which views a store handle sees: its run's own, or, without a run, the served ones.

Shared by the backends that keep views per run in a registry of their own (SQL, Redis; see
docs/runs.md). A backend gives :meth:`RunViews._all_views` (every view of every run) and
:meth:`RunViews.serving_runs`; this mixin gives :meth:`views` and the cached lookup
:meth:`_view` that every row operation starts with.
"""

from __future__ import annotations

import abc

from deltarec.errors import BadInputError
from deltarec.stores.types import ViewInfo


class RunViews(abc.ABC):
    """``views`` and ``_view`` over a backend's registry of every run's views."""

    run: str | None
    _views_cache: dict[tuple[str, int], ViewInfo]

    @abc.abstractmethod
    def _all_views(self) -> list[ViewInfo]:
        """Every view of every run (live and staging), from the registry."""

    @abc.abstractmethod
    def serving_runs(self) -> dict[str, str]:
        """Table id -> the run its serving name reads."""

    @abc.abstractmethod
    def describe(self) -> str:
        """The store's URL without credentials."""

    def views(self, staging_generation: int | None = None) -> dict[str, ViewInfo]:
        """See :meth:`Store.views`: the handle's run's views (without a run: the served ones)."""
        stage = int(staging_generation or 0)
        if self.run is None:
            served = self.serving_runs()
            return {
                v.table: v
                for v in self._all_views()
                if v.staging_generation == stage and served.get(v.table) == v.run
            }
        return {
            v.table: v
            for v in self._all_views()
            if v.staging_generation == stage and v.run == self.run
        }

    def _view(self, table: str, staging_generation: int | None = None) -> ViewInfo:
        """The view of ``table`` this handle reads and writes.

        Raises:
            BadInputError: not provisioned for the handle's run (or, without a run, no run
                serves it).
        """
        stage = int(staging_generation or 0)
        key = (table, stage)
        if self.run is None:  # what serving reads: resolved on every call (promote moves it)
            found = self.views(stage).get(table)
            if found is None:
                raise BadInputError(
                    f"no run serves table {table!r} in {self.describe()}; "
                    "provision it for a run first"
                )
            return found
        if key not in self._views_cache:
            self._views_cache.update(
                {(v.table, v.staging_generation): v for v in self.views(stage).values()}
            )
        try:
            return self._views_cache[key]
        except KeyError:
            where = f" (staging generation {stage})" if stage else ""
            raise BadInputError(
                f"table {table!r}{where} of run {self.run!r} is not provisioned in "
                f"{self.describe()}; run `deltarec provision` first"
            ) from None


def runless_problem(where: str, runs: list[str]) -> str:
    """Why a store of the runless layout written by ``runs`` is refused, and what to do."""
    who = f"runs {', '.join(map(repr, runs))}" if runs else "no run its registry names"
    return (
        f"{where} was written before rows were kept per run, by {who}: whose rows its views "
        "hold cannot be told apart, so nothing in it was changed. Publish each run into a new "
        "store from its artifacts (`deltarec provision` then `deltarec publish --artifacts ROOT "
        "--run RUN --store NEW_URL`), then promote the one to serve; the old views stay "
        "readable as they are (docs/runs.md)"
    )
