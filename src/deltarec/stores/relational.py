"""Rows and registry shared by the relational backends (SQLite, PostgreSQL).

Registry tables (plain SQL, so operators can query them; times are unix seconds):

* ``deltarec_views(name, table_id, staging_generation, dim, dtype, layout, floor_version,
  has_tombstones, created_at)``: every provisioned view; ``staging_generation`` 0 is live.
* ``deltarec_tombstones(name, key, version)``: deleted keys with the version of the delete.
* ``deltarec_generations(run, generation, registered_at, merged_at)``.
* ``deltarec_progress(run, generation, seq, table_id, rank, staging_generation, rows_done,
  complete, written_at)``: progress marks, written in the rows' transaction.
* ``deltarec_snapshots(run, generation, seq, table_id, staging_generation, version,
  swept_at)``: completed snapshot dumps (``swept_at`` NULL until applied to the live view).
* ``deltarec_serving(id, run, generation, seq, promoted_at, note)``: the serving pointer history;
  the current pointer is the newest row of a run.
* ``deltarec_freshness(run, generation, seq, rank, committed_at, visible_at)``.

SQL here is written with ``?`` placeholders; the PostgreSQL backend rewrites them to ``%s``.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from deltarec.artifacts.types import DType, TableSpec
from deltarec.errors import BadInputError, StaleGenerationError, ViewMismatchError
from deltarec.ids import make_version, validate_run
from deltarec.stores.base import Registry, Store
from deltarec.stores.naming import quote, staging_prefix, view_names
from deltarec.stores.types import (
    FreshnessRecord,
    ProgressMark,
    ReadResult,
    RowBatch,
    ServingPointer,
    SnapshotRecord,
    ViewInfo,
)

REGISTRY_DDL = (
    """CREATE TABLE IF NOT EXISTS deltarec_views (
        name TEXT PRIMARY KEY, table_id TEXT NOT NULL, staging_generation BIGINT NOT NULL,
        dim BIGINT NOT NULL, dtype TEXT NOT NULL, layout TEXT NOT NULL,
        floor_version BIGINT NOT NULL DEFAULT 0, has_tombstones BIGINT NOT NULL DEFAULT 0,
        created_at DOUBLE PRECISION NOT NULL, UNIQUE (table_id, staging_generation))""",
    """CREATE TABLE IF NOT EXISTS deltarec_tombstones (
        name TEXT NOT NULL, key BIGINT NOT NULL, version BIGINT NOT NULL,
        PRIMARY KEY (name, key))""",
    """CREATE TABLE IF NOT EXISTS deltarec_generations (
        run TEXT NOT NULL, generation BIGINT NOT NULL, registered_at DOUBLE PRECISION NOT NULL,
        merged_at DOUBLE PRECISION, PRIMARY KEY (run, generation))""",
    """CREATE TABLE IF NOT EXISTS deltarec_progress (
        run TEXT NOT NULL, generation BIGINT NOT NULL, seq BIGINT NOT NULL,
        table_id TEXT NOT NULL, rank BIGINT NOT NULL, staging_generation BIGINT NOT NULL,
        rows_done BIGINT NOT NULL, complete BIGINT NOT NULL,
        written_at DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (run, generation, seq, table_id, rank))""",
    """CREATE TABLE IF NOT EXISTS deltarec_snapshots (
        run TEXT NOT NULL, generation BIGINT NOT NULL, seq BIGINT NOT NULL,
        table_id TEXT NOT NULL, staging_generation BIGINT NOT NULL, version BIGINT NOT NULL,
        swept_at DOUBLE PRECISION, PRIMARY KEY (run, generation, seq, table_id))""",
    """CREATE TABLE IF NOT EXISTS deltarec_serving (
        run TEXT NOT NULL, generation BIGINT NOT NULL, seq BIGINT NOT NULL,
        promoted_at DOUBLE PRECISION NOT NULL, note TEXT NOT NULL,
        PRIMARY KEY (run, promoted_at))""",
    """CREATE TABLE IF NOT EXISTS deltarec_freshness (
        run TEXT NOT NULL, generation BIGINT NOT NULL, seq BIGINT NOT NULL, rank BIGINT NOT NULL,
        committed_at DOUBLE PRECISION NOT NULL, visible_at DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (run, generation, seq, rank))""",
)

_MARK_UPSERT = """INSERT INTO deltarec_progress
    (run, generation, seq, table_id, rank, staging_generation, rows_done, complete, written_at)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
    ON CONFLICT (run, generation, seq, table_id, rank) DO UPDATE SET
    staging_generation = excluded.staging_generation, rows_done = excluded.rows_done,
    complete = excluded.complete, written_at = excluded.written_at"""


class RelationalStore(Store, Registry):
    """Rows and registry of the SQL backends: provisioning, the registry tables, snapshots.

    Subclasses provide the connection (:meth:`_tx`, :meth:`_fetch`, :meth:`_exec`), the view
    DDL, and the row operations.
    """

    prefix: str
    layout: str = "bytea"

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
        """Delete rows and tombstones of ``view`` older than ``version``; raise its floor."""
        self._exec(
            cur,
            f"UPDATE deltarec_views SET floor_version = {self._GREATEST}(floor_version, ?) "
            "WHERE name = ?",
            (version, view.name),
        )
        self._exec(cur, f"DELETE FROM {quote(view.name)} WHERE version < ?", (version,))
        self._exec(
            cur,
            "DELETE FROM deltarec_tombstones WHERE name = ? AND version < ?",
            (view.name, version),
        )
        self._views_cache.clear()

    @abc.abstractmethod
    def _merge_view(self, cur: Any, stage: ViewInfo, live: ViewInfo) -> int:
        """Versioned merge of a staging view into its live view (inside the caller's tx)."""

    def _sql(self, sql: str) -> str:
        return sql

    def _exec(self, cur: Any, sql: str, params: Sequence[Any] = ()) -> Any:
        return cur.execute(self._sql(sql), tuple(params))

    def _rows(self, cur: Any, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        self._exec(cur, sql, params)
        return list(cur.fetchall())

    # ---- rows ----------------------------------------------------------------------------
    def write(
        self,
        table: str,
        keys: np.ndarray,
        embedding: np.ndarray,
        ops: np.ndarray,
        versions: np.ndarray,
        mark: ProgressMark | None = None,
        staging_generation: int | None = None,
    ) -> int:
        """See :meth:`Store.write`: a :meth:`write_batches` of one batch."""
        batch = RowBatch(keys, embedding, ops, versions)
        return self.write_batches(table, [batch], mark, staging_generation)

    @abc.abstractmethod
    def write_batches(
        self,
        table: str,
        batches: Iterable[RowBatch],
        mark: ProgressMark | None = None,
        staging_generation: int | None = None,
    ) -> int:
        """See :meth:`Store.write_batches`: one transaction (subclass)."""

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
            for ddl in REGISTRY_DDL:
                self._exec(cur, ddl)

    # ---- views ---------------------------------------------------------------------------
    def provision(
        self, tables: Mapping[str, TableSpec], staging_generation: int | None = None
    ) -> dict[str, ViewInfo]:
        """See :meth:`Store.provision`."""
        stage = int(staging_generation or 0)
        prefix = staging_prefix(self.prefix, stage) if stage else self.prefix
        names = view_names(tables, prefix)
        out: dict[str, ViewInfo] = {}
        with self._tx() as cur:
            for table, spec in tables.items():
                out[table] = self._provision_one(cur, table, names[table], spec, stage)
        self._views_cache.clear()
        return out

    def _provision_one(
        self, cur: Any, table: str, name: str, spec: TableSpec, stage: int
    ) -> ViewInfo:
        self._check_layout(table, spec)
        wanted = ViewInfo(table, name, spec.dim, DType(spec.dtype), stage)
        rows = self._rows(
            cur,
            "SELECT table_id, dim, dtype, layout, staging_generation, floor_version "
            "FROM deltarec_views WHERE name = ?",
            (name,),
        )
        if rows:
            t, dim, dtype, layout, stg, floor = rows[0]
            existing = ViewInfo(t, name, int(dim), DType(dtype), int(stg), int(floor))
            if t != table:
                raise BadInputError(
                    f"view {name!r} already holds table {t!r}; table {table!r} maps to the "
                    "same name: rename one of them or use another prefix"
                )
            if (existing.dim, existing.dtype, layout) != (spec.dim, DType(spec.dtype), self.layout):
                raise ViewMismatchError(
                    name,
                    f"{existing.describe()} layout={layout}",
                    f"{wanted.describe()} layout={self.layout} (table {table!r})",
                )
            return existing
        for ddl in self._create_view_sql(name, spec, staging=bool(stage)):
            self._exec(cur, ddl)
        self._exec(
            cur,
            "INSERT INTO deltarec_views (name, table_id, staging_generation, dim, dtype, layout, "
            "floor_version, has_tombstones, created_at) VALUES (?, ?, ?, ?, ?, ?, 0, 0, ?)",
            (name, table, stage, spec.dim, DType(spec.dtype).value, self.layout, time.time()),
        )
        return wanted

    def _check_layout(self, table: str, spec: TableSpec) -> None:
        """Subclasses reject dtypes their layout cannot hold."""

    def views(self, staging_generation: int | None = None) -> dict[str, ViewInfo]:
        """See :meth:`Store.views`."""
        stage = int(staging_generation or 0)
        return {v.table: v for v in self._all_views() if v.staging_generation == stage}

    def _all_views(self) -> list[ViewInfo]:
        with self._tx(write=False) as cur:
            rows = self._rows(
                cur,
                "SELECT table_id, name, dim, dtype, staging_generation, floor_version "
                "FROM deltarec_views",
            )
        return [ViewInfo(t, n, int(d), DType(dt), int(s), int(f)) for t, n, d, dt, s, f in rows]

    def _view(self, table: str, staging_generation: int | None = None) -> ViewInfo:
        stage = int(staging_generation or 0)
        key = (table, stage)
        if key not in self._views_cache:
            for v in self._all_views():
                self._views_cache[(v.table, v.staging_generation)] = v
        try:
            return self._views_cache[key]
        except KeyError:
            where = f" (staging generation {stage})" if stage else ""
            raise BadInputError(
                f"table {table!r}{where} is not provisioned in {self.describe()}; "
                "run `deltarec provision` first"
            ) from None

    # ---- snapshots -----------------------------------------------------------------------
    def sweep_below(self, table: str, version: int) -> None:
        """See :meth:`Store.sweep_below` (one transaction)."""
        live = self._view(table)
        with self._tx() as cur:
            self._sweep(cur, live, int(version))

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

    # ---- staging -------------------------------------------------------------------------
    def merge_staging(self, run: str, generation: int) -> int:
        """See :meth:`Store.merge_staging` (one transaction)."""
        validate_run(run)
        stages = [v for v in self._all_views() if v.staging_generation == generation]
        # Resolve the live views before the transaction: a view lookup may query the
        # registry, and SQLite cannot open a transaction within a transaction.
        lives = {stage.table: self._view(stage.table) for stage in stages}
        merged = 0
        with self._tx() as cur:
            for stage in stages:
                live = lives[stage.table]
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
        validate_run(run)
        stages = [v for v in self._all_views() if v.staging_generation == generation]
        with self._tx() as cur:
            for stage in stages:
                self._exec(cur, self._drop_view_sql(stage.name))
                self._exec(cur, "DELETE FROM deltarec_views WHERE name = ?", (stage.name,))
        self._views_cache.clear()
        return len(stages)

    # ---- registry ------------------------------------------------------------------------
    def register_generation(self, run: str, generation: int) -> None:
        """See :meth:`Registry.register_generation`."""
        validate_run(run)
        with self._tx() as cur:
            self._lock_run(cur, run, shared=False)
            self._exec(
                cur,
                "INSERT INTO deltarec_generations (run, generation, registered_at) "
                "VALUES (?, ?, ?) ON CONFLICT (run, generation) DO NOTHING",
                (run, int(generation), time.time()),
            )

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
        validate_run(mark.run)
        self._lock_run(cur, mark.run, shared=True)
        (newest,) = self._rows(
            cur, "SELECT MAX(generation) FROM deltarec_generations WHERE run = ?", (mark.run,)
        )[0]
        if newest is not None and int(newest) > mark.generation:
            raise StaleGenerationError(self.describe(), mark.run, mark.generation, int(newest))
        self._exec(
            cur,
            _MARK_UPSERT,
            (
                mark.run,
                mark.generation,
                mark.seq,
                mark.table,
                mark.rank,
                stage,
                mark.rows,
                int(mark.complete),
                time.time(),
            ),
        )

    def record_progress(self, mark: ProgressMark) -> None:
        """See :meth:`Registry.record_progress`."""
        with self._tx() as cur:
            self._write_mark(cur, mark, mark.staging_generation)

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
        return ServingPointer(run, generation, seq, now, note)

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
