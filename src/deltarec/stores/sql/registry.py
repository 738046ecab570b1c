"""The control plane of the relational stores (:class:`~deltarec.stores.base.Registry`).

Generations, progress marks (written in the rows' transaction), snapshots, freshness and the
serving pointer, in the plain SQL tables :mod:`deltarec.stores.sql.relational` lists. A promote
(:meth:`SqlRegistry.set_serving`) also points the tables' serving names at the promoted run's
live views, in the same transaction (docs/runs.md).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from deltarec.artifacts.types import DType
from deltarec.errors import StaleGenerationError
from deltarec.ids import make_version, validate_run
from deltarec.stores.base import Registry, origin_error
from deltarec.stores.naming import view_names
from deltarec.stores.types import (
    FreshnessRecord,
    ProgressMark,
    ServingPointer,
    SnapshotRecord,
    ViewInfo,
)

_MARK_UPSERT = """INSERT INTO deltarec_progress
    (run, generation, seq, table_id, rank, staging_generation, rows_done, complete, written_at)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
    ON CONFLICT (run, generation, seq, table_id, rank) DO UPDATE SET
    staging_generation = excluded.staging_generation, rows_done = excluded.rows_done,
    complete = excluded.complete, written_at = excluded.written_at"""


class SqlRegistry(Registry):
    """The registry half of :class:`~deltarec.stores.sql.relational.RelationalStore`."""

    prefix: str
    _layout_problem: str | None
    _views_cache: dict[tuple[str, int], ViewInfo]

    @abc.abstractmethod
    def _tx(self, write: bool = True) -> AbstractContextManager[Any]:
        """A transaction; yields a cursor (the store's)."""

    @abc.abstractmethod
    def _exec(self, cur: Any, sql: str, params: Sequence[Any] = ()) -> Any:
        """Run one statement (the store's dialect)."""

    @abc.abstractmethod
    def _exec_many(self, cur: Any, sql: str, params: Sequence[Sequence[Any]]) -> None:
        """Run one statement for each parameter set (the store's dialect)."""

    @abc.abstractmethod
    def _rows(self, cur: Any, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Run one query and fetch its rows."""

    @abc.abstractmethod
    def _point_serving(self, cur: Any, table: str, serving: str, view: ViewInfo) -> None:
        """Make the serving name ``serving`` of ``table`` read ``view`` (the store's views)."""

    @abc.abstractmethod
    def describe(self) -> str:
        """The store's URL without credentials."""

    # ---- for a store that keeps its control plane here (PAI FeatureStore's side registry) --
    def transaction(self, write: bool = True) -> AbstractContextManager[Any]:
        """A transaction of the registry's database; yields its cursor.

        Commits on exit, rolls back on an error. For a store whose control plane lives here
        (:mod:`deltarec.stores.featurestore`): its own tables, its fence and its marks go in
        one transaction with the registry's.
        """
        return self._tx(write)

    def execute(self, cur: Any, sql: str, params: Sequence[Any] = ()) -> Any:
        """Run one statement in transaction ``cur`` (``?`` placeholders, any dialect)."""
        return self._exec(cur, sql, params)

    def query(self, cur: Any, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Run one query in transaction ``cur`` and fetch its rows."""
        return self._rows(cur, sql, params)

    def lock_run(self, cur: Any, run: str, shared: bool) -> None:
        """Order a fence check in ``cur`` against a concurrent registration of ``run``."""
        self._lock_run(cur, run, shared)

    def write_mark(self, cur: Any, mark: ProgressMark, stage: int = 0) -> None:
        """Write ``mark`` in transaction ``cur``, fenced (see :meth:`record_progress`).

        Raises:
            StaleGenerationError: a newer generation of the mark's run is registered.
        """
        self._write_mark(cur, mark, stage)

    def snapshot(self, run: str, generation: int, seq: int, table: str) -> SnapshotRecord | None:
        """See :meth:`Registry.snapshot`."""
        with self._tx(write=False) as cur:
            rows = self._rows(
                cur,
                "SELECT staging_generation, version, swept_at FROM deltarec_snapshots "
                "WHERE run = ? AND generation = ? AND seq = ? AND table_id = ?",
                (run, generation, seq, table),
            )
        if not rows:
            return None
        stage, version, swept = rows[0]
        swept_at = None if swept is None else float(swept)
        return SnapshotRecord(run, generation, seq, table, int(stage), int(version), swept_at)

    def record_snapshot(self, record: SnapshotRecord) -> None:
        """See :meth:`Registry.record_snapshot`."""
        validate_run(record.run)
        with self._tx() as cur:
            self._exec(
                cur,
                "INSERT INTO deltarec_snapshots (run, generation, seq, table_id, "
                "staging_generation, version, swept_at) VALUES (?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (run, generation, seq, table_id) DO UPDATE SET "
                "staging_generation = excluded.staging_generation, "
                "version = excluded.version, swept_at = excluded.swept_at",
                (
                    record.run,
                    record.generation,
                    record.seq,
                    record.table,
                    record.staging_generation,
                    record.version,
                    record.swept_at,
                ),
            )

    # ---- registry ------------------------------------------------------------------------
    def register_generation(self, run: str, generation: int, origin: str | None = None) -> None:
        """See :meth:`Registry.register_generation` (``deltarec_generation_origins``)."""
        validate_run(run)
        with self._tx() as cur:
            self._lock_run(cur, run, shared=False)
            if origin is not None:
                self._exec(
                    cur,
                    "INSERT INTO deltarec_generation_origins (run, generation, created_at) "
                    "VALUES (?, ?, ?) ON CONFLICT (run, generation) DO NOTHING",
                    (run, int(generation), origin),
                )
                held = self._rows(
                    cur,
                    "SELECT created_at FROM deltarec_generation_origins "
                    "WHERE run = ? AND generation = ?",
                    (run, int(generation)),
                )
                first = str(held[0][0])
                if first != origin:
                    raise origin_error(self.describe_registry(), run, generation, first, origin)
            self._exec(
                cur,
                "INSERT INTO deltarec_generations (run, generation, registered_at) "
                "VALUES (?, ?, ?) ON CONFLICT (run, generation) DO NOTHING",
                (run, int(generation), time.time()),
            )

    def generation_origin(self, run: str, generation: int) -> str | None:
        """See :meth:`Registry.generation_origin`."""
        with self._tx(write=False) as cur:
            rows = self._rows(
                cur,
                "SELECT created_at FROM deltarec_generation_origins "
                "WHERE run = ? AND generation = ?",
                (run, int(generation)),
            )
        return str(rows[0][0]) if rows else None

    def generations(self, run: str) -> list[int]:
        """See :meth:`Registry.generations`."""
        with self._tx(write=False) as cur:
            rows = self._rows(
                cur,
                "SELECT generation FROM deltarec_generations WHERE run = ? ORDER BY generation",
                (run,),
            )
        return [int(g) for (g,) in rows]

    def _lock_run(self, cur: Any, run: str, shared: bool) -> None:
        """Order a write's fence check against a concurrent registration of ``run``.

        SQLite needs nothing (its write transactions are serial); PostgreSQL takes an advisory
        transaction lock (shared for writes, exclusive for a registration).
        """

    def _write_mark(self, cur: Any, mark: ProgressMark, stage: int) -> None:
        """Write ``mark`` in the rows' transaction, after the fence (raises; rolls all back)."""
        self._write_marks(cur, [mark], stage)

    def _write_marks(self, cur: Any, marks: Sequence[ProgressMark], stage: int | None) -> None:
        """Write ``marks`` in the rows' transaction, after the fence (raises; rolls all back).

        One fence check per run and one statement for all of them: a dump of hundreds of ranks
        writes a mark per rank and table (5,120 for 256 ranks of 20 tables), and a query and a
        statement each cost about as much as the rows of a small part. ``stage``: the staging
        generation of every mark (None: each mark's own).
        """
        if not marks:
            return
        for run in sorted({m.run for m in marks}):
            validate_run(run)
            self._lock_run(cur, run, shared=True)
            (newest,) = self._rows(
                cur, "SELECT MAX(generation) FROM deltarec_generations WHERE run = ?", (run,)
            )[0]
            oldest = min(m.generation for m in marks if m.run == run)
            if newest is not None and int(newest) > oldest:
                raise StaleGenerationError(self.describe_registry(), run, oldest, int(newest))
        now = time.time()
        params = [
            (
                m.run,
                m.generation,
                m.seq,
                m.table,
                m.rank,
                m.staging_generation if stage is None else stage,
                m.rows,
                int(m.complete),
                now,
            )
            for m in marks
        ]
        self._exec_many(cur, _MARK_UPSERT, params)

    def record_progress(self, mark: ProgressMark) -> None:
        """See :meth:`Registry.record_progress`."""
        with self._tx() as cur:
            self._write_mark(cur, mark, mark.staging_generation)

    def record_progress_many(self, marks: Sequence[ProgressMark]) -> None:
        """See :meth:`Registry.record_progress_many`: one transaction (one commit)."""
        if not marks:
            return
        with self._tx() as cur:
            self._write_marks(cur, marks, None)

    def progress(self, run: str, generation: int) -> list[ProgressMark]:
        """See :meth:`Registry.progress`."""
        with self._tx(write=False) as cur:
            rows = self._rows(
                cur,
                "SELECT seq, table_id, rank, rows_done, complete, staging_generation, written_at "
                "FROM deltarec_progress WHERE run = ? AND generation = ? "
                "ORDER BY seq, table_id, rank",
                (run, generation),
            )
        return [
            ProgressMark(run, generation, int(s), t, int(r), int(n), bool(c), int(g), float(w))
            for s, t, r, n, c, g, w in rows
        ]

    def record_freshness(self, record: FreshnessRecord) -> None:
        """See :meth:`Registry.record_freshness` (the first record of a rank's dump is kept)."""
        with self._tx() as cur:
            self._exec(
                cur,
                "INSERT INTO deltarec_freshness (run, generation, seq, rank, committed_at, "
                "visible_at) VALUES (?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (run, generation, seq, rank) DO NOTHING",
                (
                    record.run,
                    record.generation,
                    record.seq,
                    record.rank,
                    record.committed_at,
                    record.visible_at,
                ),
            )

    def freshness(self, run: str, generation: int | None = None) -> list[FreshnessRecord]:
        """See :meth:`Registry.freshness`."""
        sql = (
            "SELECT generation, seq, rank, committed_at, visible_at FROM deltarec_freshness "
            "WHERE run = ?"
        )
        params: list[Any] = [run]
        if generation is not None:
            sql += " AND generation = ?"
            params.append(generation)
        with self._tx(write=False) as cur:
            rows = self._rows(cur, sql + " ORDER BY generation, seq, rank", params)
        return [
            FreshnessRecord(run, int(g), int(s), int(r), float(c), float(v))
            for g, s, r, c, v in rows
        ]

    def set_serving(self, run: str, generation: int, seq: int, note: str = "") -> ServingPointer:
        """See :meth:`Registry.set_serving`."""
        validate_run(run)
        make_version(generation, seq)
        with self._tx() as cur:
            last = self._rows(
                cur, "SELECT MAX(promoted_at) FROM deltarec_serving WHERE run = ?", (run,)
            )[0][0]
            now = max(time.time(), float(last or 0.0) + 1e-6)  # strictly increasing per run
            self._exec(
                cur,
                "INSERT INTO deltarec_serving (run, generation, seq, promoted_at, note) "
                "VALUES (?, ?, ?, ?, ?)",
                (run, generation, seq, now, note),
            )
            self._switch_serving(cur, run)
        self._views_cache.clear()
        return ServingPointer(run, generation, seq, now, note)

    def _switch_serving(self, cur: Any, run: str) -> None:
        """Point the serving name of every table ``run`` has a live view of at that view."""
        if self._layout_problem:
            return
        names = dict(self._rows(cur, "SELECT table_id, name FROM deltarec_serving_views"))
        rows = self._rows(
            cur,
            "SELECT table_id, name, dim, dtype FROM deltarec_views "
            "WHERE run = ? AND staging_generation = 0",
            (run,),
        )
        for table, name, dim, dtype in rows:
            view = ViewInfo(table, name, int(dim), DType(dtype), run=run)
            serving = names.get(table) or view_names([table], self.prefix)[table]
            self._point_serving(cur, table, serving, view)

    def serving_history(self, run: str) -> list[ServingPointer]:
        """See :meth:`Registry.serving_history`."""
        with self._tx(write=False) as cur:
            rows = self._rows(
                cur,
                "SELECT generation, seq, promoted_at, note FROM deltarec_serving WHERE run = ? "
                "ORDER BY promoted_at",
                (run,),
            )
        return [ServingPointer(run, int(g), int(s), float(p), str(n)) for g, s, p, n in rows]
