"""Rows and registry shared by the relational backends (SQLite, PostgreSQL).

Registry tables (plain SQL, so operators can query them; times are unix seconds):

* ``deltarec_views(name, run, table_id, staging_generation, dim, dtype, layout, floor_version,
  has_tombstones, created_at)``: every provisioned view, each one run's own (docs/runs.md);
  ``staging_generation`` 0 is live.
* ``deltarec_serving_views(table_id, name, run, switched_at)``: each table's serving name (a
  SQL view) and the run whose live view it reads.
* ``deltarec_tombstones(name, key, version)``: deleted keys with the version of the delete.
* ``deltarec_generations(run, generation, registered_at, merged_at)``.
* ``deltarec_generation_origins(run, generation, created_at)``: the ``created_at`` of the
  artifacts each generation was published from (docs/runs.md, rule 5).
* ``deltarec_progress(run, generation, seq, table_id, rank, staging_generation, rows_done,
  complete, written_at)``: progress marks, written in the rows' transaction.
* ``deltarec_snapshots(run, generation, seq, table_id, staging_generation, version,
  swept_at)``: completed snapshot dumps (``swept_at`` NULL until applied to the live view).
* ``deltarec_serving(id, run, generation, seq, promoted_at, note)``: the serving pointer history;
  the current pointer is the newest row of a run.
* ``deltarec_freshness(run, generation, seq, rank, committed_at, visible_at)``.
* ``deltarec_store_id(one, id, created_at)``: one row, the random id the store keeps in itself
  (:meth:`~deltarec.stores.base.Registry.store_uuid`), written by the first handle to open it.
* ``deltarec_prefix(one, prefix)``: one row, the view prefix whose names the registry holds.
  The registry is one per schema (SQLite: per file) and keys serving names by table, so a
  handle of another prefix is refused at open (:meth:`_claim_prefix`).
* ``deltarec_featurestore_view(one, view)``: one row where the registry is a PAI FeatureStore
  view's (``featurestore://project/view?region=r``, written by the view's registry handle): a
  handle of another view, or a SQL store's own handle, is refused at open
  (:meth:`_claim_featurestore`).
* ``deltarec_low_marks(name, version)``: per live view a version no row of it is below, so
  a snapshot's sweep of a view holding nothing older is no scan (see :meth:`_sweep`). Set at
  provision for a view created empty, lowered in every write's transaction that brings rows
  older than it, raised by a completed sweep, removed by a merge; a view without one is
  scanned.

SQL here is written with ``?`` placeholders; the PostgreSQL backend rewrites them to ``%s``.
"""

from __future__ import annotations

import abc
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from deltarec.artifacts.types import DType, TableSpec
from deltarec.errors import BadInputError, ViewMismatchError
from deltarec.stores.base import Store
from deltarec.stores.naming import quote, staging_prefix, view_names
from deltarec.stores.runviews import RunViews
from deltarec.stores.sql.ddl import REGISTRY_DDL, VIEWS_DDL
from deltarec.stores.sql.legacy import LegacyDialect, migrate_legacy_views
from deltarec.stores.sql.registry import SqlRegistry
from deltarec.stores.types import (
    Capabilities,
    ReadResult,
    RowBatch,
    ViewInfo,
)

_NO_ROWS = (1 << 63) - 1
"""The low mark of a view holding no rows (no version is above it)."""


class LowestVersion:
    """Passes batches on and keeps the lowest version among their rows (None: no rows)."""

    def __init__(self, batches: Iterable[RowBatch]) -> None:
        self._batches = batches
        self.version: int | None = None

    def __iter__(self) -> Iterator[RowBatch]:
        for batch in self._batches:
            versions = np.asarray(batch.versions)
            if versions.size:
                low = int(versions.min())
                self.version = low if self.version is None else min(self.version, low)
            yield batch


class RelationalStore(RunViews, SqlRegistry, Store):
    """Rows and registry of the SQL backends: provisioning, the registry tables, snapshots.

    Subclasses provide the connection (:meth:`_tx`, :meth:`_rows`, :meth:`_exec`), the view
    DDL, and the row operations.
    """

    capabilities = Capabilities(
        deletes=True,
        atomic_marks=True,
        atomic_merge=True,
        staging=True,
        scan=True,
        snapshot_replace=True,
        whole_writes=True,
        batch_bytes=512 << 20,
    )
    prefix: str
    layout: str = "bytea"
    _layout_problem: str | None = None
    """Why this store's (runless, legacy) layout is refused, or None (:mod:`.legacy`)."""
    registry_of: str | None = None
    """The FeatureStore view (``featurestore://project/view?region=r``) this handle holds the
    registry of, or None: a store of its own views (see :meth:`_claim_featurestore`)."""

    # ---- connection primitives (subclass) ------------------------------------------------
    @abc.abstractmethod
    def _tx(self, write: bool = True) -> AbstractContextManager[Any]:
        """A transaction (exclusive where the backend needs it for writes); yields a cursor."""

    @abc.abstractmethod
    def _create_view_sql(self, name: str, spec: TableSpec, staging: bool) -> list[str]:
        """DDL creating one view (live or staging), idempotent."""

    def _drop_view_sql(self, name: str) -> str:
        """DDL dropping one view."""
        return f"DROP TABLE IF EXISTS {quote(name)}"

    _GREATEST = "MAX"
    """The dialect's two-argument maximum (SQLite's scalar ``MAX``, PostgreSQL's ``GREATEST``)."""

    def _sweep(self, cur: Any, view: ViewInfo, version: int) -> None:
        """Delete rows and tombstones of ``view`` older than ``version``; raise its floor.

        The view's rows are scanned only if its low mark is below ``version`` or it has none;
        afterwards no row is below ``version``, so the mark is raised to it.
        """
        self._exec(
            cur,
            f"UPDATE deltarec_views SET floor_version = {self._GREATEST}(floor_version, ?) "
            "WHERE name = ?",
            (version, view.name),
        )
        low = self._rows(cur, "SELECT version FROM deltarec_low_marks WHERE name = ?", (view.name,))
        if not low or int(low[0][0]) < version:
            self._exec(cur, f"DELETE FROM {quote(view.name)} WHERE version < ?", (version,))
        self._exec(
            cur,
            "DELETE FROM deltarec_tombstones WHERE name = ? AND version < ?",
            (view.name, version),
        )
        self._exec(
            cur,
            "INSERT INTO deltarec_low_marks (name, version) VALUES (?, ?) ON CONFLICT (name) "
            f"DO UPDATE SET version = {self._GREATEST}(deltarec_low_marks.version, "
            "excluded.version)",
            (view.name, version),
        )
        self._views_cache.clear()

    def _lower_low_mark(self, cur: Any, view: ViewInfo, lowest: LowestVersion) -> None:
        """Lower live ``view``'s low mark to the lowest version written (in the write's tx).

        Call it last in the transaction: on PostgreSQL the update locks the mark's row until
        commit, and only a write bringing rows older than the mark takes that lock.
        """
        if view.staging_generation or lowest.version is None:
            return
        self._exec(
            cur,
            "UPDATE deltarec_low_marks SET version = ? WHERE name = ? AND version > ?",
            (lowest.version, view.name, lowest.version),
        )

    @abc.abstractmethod
    def _merge_view(self, cur: Any, stage: ViewInfo, live: ViewInfo) -> int:
        """Versioned merge of a staging view into its live view (inside the caller's tx)."""

    def _sql(self, sql: str) -> str:
        return sql

    def _exec(self, cur: Any, sql: str, params: Sequence[Any] = ()) -> Any:
        return cur.execute(self._sql(sql), tuple(params))

    def _exec_many(self, cur: Any, sql: str, params: Sequence[Sequence[Any]]) -> None:
        cur.executemany(self._sql(sql), [tuple(p) for p in params])

    def _rows(self, cur: Any, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        self._exec(cur, sql, params)
        return list(cur.fetchall())

    # ---- rows ----------------------------------------------------------------------------
    # subclasses apply a write in one transaction (Store.apply).
    _read_chunk: int
    """Keys per ``SELECT`` of :meth:`read` (the dialect's limits)."""

    def read(
        self, table: str, keys: np.ndarray, staging_generation: int | None = None
    ) -> ReadResult:
        """See :meth:`Store.read` (one read transaction, a ``SELECT`` per chunk of keys)."""
        view = self._view(table, staging_generation)
        keys = np.asarray(keys, dtype=np.int64)
        out = ReadResult.none_found(view, len(keys))
        position = {int(k): i for i, k in enumerate(keys.tolist())}
        live = " AND op = 0" if view.staging_generation else ""  # a staged delete: not found
        with self._tx(write=False) as cur:
            for start in range(0, len(keys), self._read_chunk):
                where, params = self._keys_in(keys[start : start + self._read_chunk].tolist())
                sql = f"SELECT key, embedding, version FROM {quote(view.name)} WHERE {where}"
                for key, value, version in self._rows(cur, sql + live, params):
                    i = position[int(key)]
                    out.found[i] = True
                    out.versions[i] = version
                    out.embedding[i] = self._decode(value, view, out.embedding.dtype)
        return out

    def _keys_in(self, keys: list[int]) -> tuple[str, Sequence[Any]]:
        """The ``WHERE`` condition that picks ``keys``, and its parameters."""
        return f"key IN ({', '.join('?' * len(keys))})", keys

    def _decode(self, value: Any, view: ViewInfo, element: np.dtype) -> np.ndarray:
        """One stored embedding as an encoded row (the stored bytes, as is)."""
        return np.frombuffer(value, dtype=element)

    def _create_registry(self) -> None:
        with self._tx() as cur:
            self._create_registry_in(cur)

    def _create_registry_in(self, cur: Any) -> None:
        """The registry's DDL, after moving a store of the runless layout over (in ``cur``)."""
        dialect = LegacyDialect(
            self.prefix,
            self.describe(),
            self._columns,
            self._rows,
            self._exec,
            self._drop_view_sql,
            self._point_serving,
        )
        self._layout_problem = migrate_legacy_views(dialect, cur)
        for ddl in REGISTRY_DDL:
            if ddl is VIEWS_DDL and self._layout_problem:
                continue  # the legacy registry stays as it is (refused, untouched)
            self._exec(cur, ddl)
        if not self._rows(cur, "SELECT id FROM deltarec_store_id WHERE one = 1"):
            self._exec(
                cur,
                "INSERT INTO deltarec_store_id (one, id, created_at) VALUES (1, ?, ?) "
                "ON CONFLICT (one) DO NOTHING",
                (uuid.uuid4().hex, time.time()),
            )
        self._claim_featurestore(cur)
        self._claim_prefix(cur)

    def _claim_featurestore(self, cur: Any) -> None:
        """Record the FeatureStore view whose registry this is; refuse any other handle.

        A FeatureStore view keeps its registry (its runs' versions, generations, marks, which
        run serves) in a SQL store; a second view, or a SQL store serving its own views, in the
        same schema (file) would share them. The first view to open a registry records itself
        (one written before ``deltarec_featurestore_view`` existed is claimed by the first view
        that opens it); a registry a SQL store already serves views from is not taken.
        """
        rows = self._rows(cur, "SELECT view FROM deltarec_featurestore_view WHERE one = 1")
        held = str(rows[0][0]) if rows else None
        legacy = held is None and bool(self._columns(cur, "deltarec_featurestore_versions"))
        mine = self.registry_of
        if mine is None:
            if held is not None or legacy:
                own = f"a store of its own views (prefix {self.prefix!r})"
                raise self._claim_error(held or "a FeatureStore view", own)
            return
        if held == mine:
            return
        if held is not None:
            raise self._claim_error(held, mine)
        if self._layout_problem or (
            not legacy and self._rows(cur, "SELECT name FROM deltarec_views LIMIT 1")
        ):
            prefix = self._rows(cur, "SELECT prefix FROM deltarec_prefix WHERE one = 1")
            owner = f"prefix {prefix[0][0]!r}" if prefix else "its own prefix"
            raise self._claim_error(f"a SQL store's own views ({owner})", mine)
        self._exec(
            cur,
            "INSERT INTO deltarec_featurestore_view (one, view) VALUES (1, ?) "
            "ON CONFLICT (one) DO NOTHING",
            (mine,),
        )
        rows = self._rows(cur, "SELECT view FROM deltarec_featurestore_view WHERE one = 1")
        if str(rows[0][0]) != mine:  # another view claimed it meanwhile
            raise self._claim_error(str(rows[0][0]), mine)

    def describe_registry(self) -> str:
        """The URL; a FeatureStore view's registry: the view, then its registry's URL."""
        if self.registry_of is None:
            return self.describe()
        return f"{self.registry_of} (registry {self.describe()})"

    def _claim_error(self, held: str, mine: str) -> BadInputError:
        return BadInputError(
            f"{self._registry_place()} holds the registry of {held}, not of {mine}: a "
            f"registry (which run serves each table, generations, marks, FeatureStore "
            f"versions) is one per FeatureStore view or SQL store, so the second would "
            f"serve, promote and roll back the first's runs. Give each its own "
            f"{self._registry_unit} (a FeatureStore view: registry=<store URL>)"
        )

    def _claim_prefix(self, cur: Any) -> None:
        """Record the handle's view prefix in a new registry; refuse one of another prefix.

        A registry written before ``deltarec_prefix`` existed is claimed only where each of its
        serving names is the one this prefix gives its table.
        """
        query = "SELECT prefix FROM deltarec_prefix WHERE one = 1"
        rows = self._rows(cur, query)
        if not rows:
            for table, name in self._rows(cur, "SELECT table_id, name FROM deltarec_serving_views"):
                if view_names([str(table)], self.prefix)[str(table)] != name:
                    raise self._prefix_error(f"serving name {name!r} of table {table!r}")
            self._exec(
                cur,
                "INSERT INTO deltarec_prefix (one, prefix) VALUES (1, ?) "
                "ON CONFLICT (one) DO NOTHING",
                (self.prefix,),
            )
            rows = self._rows(cur, query)
        if rows[0][0] != self.prefix:
            raise self._prefix_error(f"views of prefix {rows[0][0]!r}")

    def _prefix_error(self, held: str) -> BadInputError:
        return BadInputError(
            f"{self._registry_place()} holds the registry of the {held}, not of prefix "
            f"{self.prefix!r}: the registry (which run serves each table, generations, marks) "
            f"is one per {self._registry_unit}, so views of a second prefix beside them would "
            f"serve, promote and roll back the same tables. Open it with the prefix it holds, "
            f"or give the new prefix a {self._registry_unit} of its own"
        )

    _registry_unit = "schema"
    """What holds one registry (dialect): ``schema`` (PostgreSQL), ``file`` (SQLite)."""

    def _registry_place(self) -> str:
        """The schema or file that holds the registry, for messages (dialect; no password)."""
        return self.describe()

    def store_uuid(self) -> str | None:
        """See :meth:`Registry.store_uuid` (``deltarec_store_id``)."""
        with self._tx(write=False) as cur:
            rows = self._rows(cur, "SELECT id FROM deltarec_store_id WHERE one = 1")
        return str(rows[0][0]) if rows else None

    def _columns(self, cur: Any, table: str) -> set[str]:
        """The column names of registry table ``table`` (empty if there is none; dialect)."""
        raise NotImplementedError

    # ---- views ---------------------------------------------------------------------------
    def provision(
        self, tables: Mapping[str, TableSpec], staging_generation: int | None = None
    ) -> dict[str, ViewInfo]:
        """See :meth:`Store.provision`: the handle's run's views, and serving names for new tables.

        A table no run serves yet gets its serving name, reading this run's live view; a table
        another run serves keeps serving that run's rows until this run is promoted.
        """
        self._check_layout_problem()
        run = self._writer("provisioning views")
        stage = int(staging_generation or 0)
        prefix = staging_prefix(self.prefix, stage) if stage else self.prefix
        names = view_names(tables, prefix, run=run)
        out: dict[str, ViewInfo] = {}
        with self._tx() as cur:
            for table, spec in tables.items():
                out[table] = self._provision_one(cur, run, table, names[table], spec, stage)
                if not stage:
                    self._claim_serving_name(cur, out[table])
        self._views_cache.clear()
        return out

    def _provision_one(
        self, cur: Any, run: str, table: str, name: str, spec: TableSpec, stage: int
    ) -> ViewInfo:
        self._check_layout(table, spec)
        wanted = ViewInfo(table, name, spec.dim, DType(spec.dtype), stage, run=run)
        rows = self._rows(
            cur,
            "SELECT run, table_id, dim, dtype, layout, staging_generation, floor_version "
            "FROM deltarec_views WHERE name = ?",
            (name,),
        )
        if rows:
            r, t, dim, dtype, layout, stg, floor = rows[0]
            existing = ViewInfo(t, name, int(dim), DType(dtype), int(stg), int(floor), run=r)
            if (r, t) != (run, table):
                raise BadInputError(
                    f"view {name!r} already holds table {t!r} of run {r!r}; table {table!r} of "
                    f"run {run!r} maps to the same name: rename one of them or use another prefix"
                )
            if (existing.dim, existing.dtype, layout) != (spec.dim, DType(spec.dtype), self.layout):
                raise ViewMismatchError(
                    name,
                    f"{existing.describe()} layout={layout}",
                    f"{wanted.describe()} layout={self.layout} (table {table!r})",
                )
            return existing
        serving = self._rows(
            cur, "SELECT table_id FROM deltarec_serving_views WHERE name = ?", (name,)
        )
        if serving:
            raise BadInputError(
                f"view name {name!r} of table {table!r} of run {run!r} is the serving name of "
                f"table {serving[0][0]!r}: rename the run or the table, or use another prefix"
            )
        for ddl in self._create_view_sql(name, spec, staging=bool(stage)):
            self._exec(cur, ddl)
        self._exec(cur, "DELETE FROM deltarec_low_marks WHERE name = ?", (name,))
        if not stage:  # a view created empty holds nothing below any version
            self._exec(
                cur,
                "INSERT INTO deltarec_low_marks (name, version) SELECT ?, ? "
                f"WHERE NOT EXISTS (SELECT 1 FROM {quote(name)})",
                (name, _NO_ROWS),
            )
        self._exec(
            cur,
            "INSERT INTO deltarec_views (name, run, table_id, staging_generation, dim, dtype, "
            "layout, floor_version, has_tombstones, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, 0, 0, ?)",
            (name, run, table, stage, spec.dim, DType(spec.dtype).value, self.layout, time.time()),
        )
        return wanted

    def _claim_serving_name(self, cur: Any, view: ViewInfo) -> None:
        """Give ``view``'s table a serving name reading ``view`` if no run serves it yet."""
        if self._rows(
            cur, "SELECT run FROM deltarec_serving_views WHERE table_id = ?", (view.table,)
        ):
            return
        serving = view_names([view.table], self.prefix)[view.table]
        taken = self._rows(
            cur, "SELECT run, table_id FROM deltarec_views WHERE name = ?", (serving,)
        )
        if taken:
            raise BadInputError(
                f"the serving name {serving!r} of table {view.table!r} is the view of table "
                f"{taken[0][1]!r} of run {taken[0][0]!r}: rename one of them or use another prefix"
            )
        self._point_serving(cur, view.table, serving, view)

    def _point_serving(self, cur: Any, table: str, serving: str, view: ViewInfo) -> None:
        """(Re)define the SQL view ``serving`` as ``view``'s rows and record it (in ``cur``)."""
        for ddl in self._serving_view_sql(serving, view.name):
            self._exec(cur, ddl)
        self._exec(
            cur,
            "INSERT INTO deltarec_serving_views (table_id, name, run, switched_at) "
            "VALUES (?, ?, ?, ?) ON CONFLICT (table_id) DO UPDATE SET run = excluded.run, "
            "switched_at = excluded.switched_at",
            (table, serving, view.run, time.time()),
        )

    def _serving_view_sql(self, serving: str, physical: str) -> list[str]:
        """DDL that makes ``serving`` read ``physical``'s rows (one transaction with the rest)."""
        return [
            f"DROP VIEW IF EXISTS {quote(serving)}",
            f"CREATE VIEW {quote(serving)} AS SELECT key, embedding, version, updated_at "
            f"FROM {quote(physical)}",
        ]

    def _check_layout(self, table: str, spec: TableSpec) -> None:
        """Subclasses reject dtypes their layout cannot hold."""

    def _check_layout_problem(self) -> None:
        if self._layout_problem:
            raise BadInputError(self._layout_problem)

    def _all_views(self) -> list[ViewInfo]:
        self._check_layout_problem()
        with self._tx(write=False) as cur:
            rows = self._rows(
                cur,
                "SELECT table_id, name, dim, dtype, staging_generation, floor_version, run "
                "FROM deltarec_views",
            )
        return [
            ViewInfo(t, n, int(d), DType(dt), int(s), int(f), run=r)
            for t, n, d, dt, s, f, r in rows
        ]

    def serving_runs(self) -> dict[str, str]:
        """See :meth:`Registry.serving_runs`."""
        with self._tx(write=False) as cur:
            rows = self._rows(cur, "SELECT table_id, run FROM deltarec_serving_views")
        return {str(t): str(r) for t, r in rows}

    # ---- snapshots -----------------------------------------------------------------------
    def sweep_below(self, table: str, version: int) -> None:
        """See :meth:`Store.sweep_below` (one transaction)."""
        self._writer("removing rows below a snapshot")
        live = self._view(table)
        with self._tx() as cur:
            self._sweep(cur, live, int(version))

    # ---- staging -------------------------------------------------------------------------
    def merge_staging(self, run: str, generation: int) -> int:
        """See :meth:`Store.merge_staging` (one transaction)."""
        self._check_run(run, "merging staging views")
        stages = [
            v for v in self._all_views() if v.staging_generation == generation and v.run == run
        ]
        # Resolve the live views before the transaction: a view lookup may query the
        # registry, and SQLite cannot open a transaction within a transaction.
        lives = {stage.table: self._view(stage.table) for stage in stages}
        merged = 0
        with self._tx() as cur:
            for stage in stages:
                live = lives[stage.table]
                # the staged rows' versions are not known here: the view's mark is dropped
                # (a later sweep scans it once and sets it again)
                self._exec(cur, "DELETE FROM deltarec_low_marks WHERE name = ?", (live.name,))
                merged += self._merge_view(cur, stage, live)
                snaps = self._rows(
                    cur,
                    "SELECT version FROM deltarec_snapshots WHERE run = ? AND generation = ? "
                    "AND table_id = ? AND staging_generation = ? AND swept_at IS NULL",
                    (run, generation, stage.table, generation),
                )
                for (version,) in snaps:
                    self._sweep(cur, live, int(version))
                self._exec(cur, self._drop_view_sql(stage.name))
                self._exec(cur, "DELETE FROM deltarec_views WHERE name = ?", (stage.name,))
            self._exec(
                cur,
                "UPDATE deltarec_snapshots SET swept_at = ? WHERE run = ? AND generation = ? "
                "AND staging_generation = ? AND swept_at IS NULL",
                (time.time(), run, generation, generation),
            )
            self._exec(
                cur,
                "UPDATE deltarec_generations SET merged_at = ? WHERE run = ? AND generation = ?",
                (time.time(), run, generation),
            )
        self._views_cache.clear()
        return merged

    def drop_staging(self, run: str, generation: int) -> int:
        """See :meth:`Store.drop_staging` (one transaction)."""
        self._check_run(run, "dropping staging views")
        stages = [
            v for v in self._all_views() if v.staging_generation == generation and v.run == run
        ]
        with self._tx() as cur:
            for stage in stages:
                self._exec(cur, self._drop_view_sql(stage.name))
                self._exec(cur, "DELETE FROM deltarec_views WHERE name = ?", (stage.name,))
        self._views_cache.clear()
        return len(stages)

    # ---- helpers for subclasses ----------------------------------------------------------
    def _view_state(self, cur: Any, name: str, lock: str = "") -> tuple[int, bool]:
        rows = self._rows(
            cur,
            f"SELECT floor_version, has_tombstones FROM deltarec_views WHERE name = ?{lock}",
            (name,),
        )
        if not rows:
            raise BadInputError(f"view {name!r} was dropped; provision it again")
        return int(rows[0][0]), bool(rows[0][1])

    def count_keys(self, table: str) -> int:
        """See :meth:`Store.count_keys` (one ``count(*)``: the key index, where it suffices)."""
        name = self._view(table).name
        with self._tx(write=False) as cur:
            return int(self._rows(cur, f"SELECT count(*) FROM {quote(name)}")[0][0])

    def scan_keys(self, table: str, batch_rows: int = 65536) -> Iterator[np.ndarray]:
        """See :meth:`Store.scan_keys` (ascending)."""
        for page in self._pages(self._view(table).name, "key", batch_rows):
            yield np.fromiter((k for (k,) in page), np.int64, len(page))

    def _pages(self, name: str, columns: str, batch_rows: int) -> Iterator[list[tuple[Any, ...]]]:
        """``columns`` (``key`` first) of every row of view ``name``, ascending by key.

        Keyset-paged: pages of ``batch_rows`` rows, each one ``SELECT`` in a read transaction of
        its own, from the key after the last page's on.
        """
        quoted = quote(name)
        last: int | None = None
        while True:
            with self._tx(write=False) as cur:
                if last is None:
                    sql = f"SELECT {columns} FROM {quoted} ORDER BY key LIMIT ?"
                    params: tuple[Any, ...] = (batch_rows,)
                else:
                    sql = f"SELECT {columns} FROM {quoted} WHERE key > ? ORDER BY key LIMIT ?"
                    params = (last, batch_rows)
                page = self._rows(cur, sql, params)
            if not page:
                return
            yield page
            last = int(page[-1][0])
            if len(page) < batch_rows:
                return

    _views_cache: dict[tuple[str, int], ViewInfo]
