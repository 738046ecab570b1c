"""PostgreSQL (and wire-compatible Hologres) store: COPY, new keys straight in, versioned merge.

Each view is a table ``key BIGINT PRIMARY KEY, embedding BYTEA | REAL[], version BIGINT NOT
NULL, updated_at TIMESTAMPTZ`` in the configured schema (``bytea`` = the encoded row packed
little-endian; ``float4[]`` = its values, for float32/float16 tables), so an outside reader gets
a row with one plain query. A write (one batch, or many streamed in) is one transaction: rows
of keys the view does not hold yet are copied straight into it (binary ``COPY``, in groups of
up to 32 MB, each in a savepoint); the others are copied into a per-session ``TEMP`` table
(``ON COMMIT DELETE ROWS``) and applied by one versioned merge (``MERGE``, or ``INSERT ... ON
CONFLICT DO UPDATE ... WHERE version <= EXCLUDED.version``) in key order (and a guarded
``DELETE`` + tombstone for ``op = 1``); then the progress mark. A lost connection raises
:class:`~deltarec.errors.StoreUnavailableError` and the next call reconnects; the publisher
retries.

This module holds the connection, the DDL, the merges and the reads;
:mod:`.pgload` copies a write's rows in, :mod:`.pgcopy` encodes
them.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from typing import Any

import numpy as np
import psycopg
from psycopg import errors as pgerrors

from deltarec.artifacts import codec
from deltarec.artifacts.types import DType, TableSpec
from deltarec.errors import ConfigError, StoreError
from deltarec.stores.base import first_batch
from deltarec.stores.config import PostgresConfig
from deltarec.stores.errors import DriverErrors
from deltarec.stores.naming import quote
from deltarec.stores.sql.pgcopy import FLOAT4_OID, decode_float4_array
from deltarec.stores.sql.pgload import BATCH_TABLES, Sent, copy_rows, sorted_rows
from deltarec.stores.sql.relational import LowestVersion, RelationalStore
from deltarec.stores.types import ReadResult, ViewInfo, Write

_DDL_LOCK = 0x64656C7461726563  # "deltarec": serializes concurrent DDL of several ranks
_WALK = 4
"""A merge of at least 1/4 of the view's size (by the tables' files) goes by a merge join:
the batch table gets an index on its keys (a sort of keys only), and both indexes are read once
in key order. Below that, a nested loop descends the view's index per row, which is cheaper
than reading all of the view. Updating 1M keys of a 1M-row view: ~14 % faster (median of 3
runs), 500k of 2M: ~15 %; 250k of 2M: ~20 % slower, 100k of 2M: 2x slower (nested loop kept).
A view at fillfactor 50 takes about twice its rows' bytes, so 1/4 by size is 1/4 to 1/2 of
its rows."""
_WALK_MIN_BYTES = 16 << 20
"""Smaller merges keep the nested loop: no index is made and dropped for them."""
FILLFACTOR = 50
"""Live views leave half of each page free, so a row's new version fits in its page (a HOT
update: no new index entry). Updating every key of 1M rows of dim 64 merges ~2x faster than
in full pages; the table takes about twice the space."""
_SESSION = ("SET temp_buffers = '160MB'", "SET work_mem = '64MB'", "SET jit = off")
"""Per-session settings: the batch table of a large write stays mostly in memory (PostgreSQL's
default 8 MB of temp buffers spills it to files), the merge's sort does not spill as early, and
no JIT compilation (it adds a fixed 0.1-0.5 s to every large merge and saves nothing on these
simple rows). Durability settings are left as the server has them."""
_TRANSIENT = (
    psycopg.OperationalError,  # connection refused/reset, admin shutdown, query canceled
    pgerrors.SerializationFailure,
    pgerrors.DeadlockDetected,
    pgerrors.LockNotAvailable,
)
_ERRORS = DriverErrors(psycopg.Error, lambda e: isinstance(e, _TRANSIENT))
"""psycopg's errors as the store contract's (see :mod:`deltarec.stores.errors`)."""


def _ensure_schema(conn: psycopg.Connection[Any], name: str, quoted: str) -> None:
    """Create schema ``name`` unless it exists (``conn`` in autocommit).

    ``CREATE SCHEMA IF NOT EXISTS`` is not atomic: run by two ranks at once, the second waits
    for the first's and then fails on ``pg_namespace``'s unique index. The schema then exists,
    which is all that was asked. An existing schema is not created again, so a role without
    ``CREATE`` on the database can use a schema made for it.
    """
    found = conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (name,)).fetchone()
    if found is not None:
        return
    # Created by another connection meanwhile: committed, since its insert was waited for.
    with suppress(pgerrors.UniqueViolation, pgerrors.DuplicateSchema):
        conn.execute(f"CREATE SCHEMA IF NOT EXISTS {quoted}")


class PostgresStore(RelationalStore):
    """The PostgreSQL backend (psycopg 3). One connection, guarded by a lock.

    Args:
        config: the parsed ``postgresql://`` URL.
        registry_of: see :attr:`RelationalStore.registry_of`.
    """

    kind = "postgres"
    _GREATEST = "GREATEST"
    _read_chunk = 10000

    def __init__(self, config: PostgresConfig, registry_of: str | None = None) -> None:
        self.config, self.registry_of = config, registry_of
        self.prefix, self.layout = config.prefix, config.layout
        self._lock = threading.RLock()
        self._conn: psycopg.Connection[Any] | None = None
        self._closed = False
        self._views_cache: dict[tuple[str, int], ViewInfo] = {}
        self._create_registry()

    def describe(self) -> str:
        """The URL without password."""
        c = self.config
        user = f"{c.user}@" if c.user else ""
        return f"postgresql://{user}{c.host}:{c.port}/{c.dbname}"

    def _registry_place(self) -> str:
        return f"schema {self.config.schema_name!r} of {self.describe()}"

    def place(self) -> str:
        """See :meth:`Store.place`: server, database, schema and prefix (no user)."""
        c = self.config
        where = f"{c.host.lower()}:{c.port}/{c.dbname}"
        return f"postgresql://{where}?schema={c.schema_name}&prefix={c.prefix}"

    # ---- connection ----------------------------------------------------------------------
    def connect_params(self) -> dict[str, Any]:
        """``psycopg.connect``'s arguments for this store's server (also a probe reader's)."""
        c = self.config
        params: dict[str, Any] = {
            "host": c.host,
            "port": c.port,
            "dbname": c.dbname,
            "connect_timeout": c.connect_timeout,
            "application_name": "deltarec",
        }
        for name in ("user", "password", "sslmode"):
            if getattr(c, name):
                params[name] = getattr(c, name)
        return params

    def _connect(self) -> psycopg.Connection[Any]:
        if self._closed:
            raise StoreError(f"{self.describe()} is closed")
        if self._conn is not None and not self._conn.closed:
            return self._conn
        c = self.config
        with _ERRORS.map_errors(self.describe()):
            conn = psycopg.connect(autocommit=True, **self.connect_params())
            schema = quote(c.schema_name)
            _ensure_schema(conn, c.schema_name, schema)
            conn.execute(f"SET search_path TO {schema}")
            for setting in _SESSION:  # before the session's first temp table
                conn.execute(setting)
            for layout, table in BATCH_TABLES.items():
                emb = "BYTEA" if layout == "bytea" else "REAL[]"
                conn.execute(
                    f"CREATE TEMP TABLE IF NOT EXISTS {table} (key BIGINT NOT NULL, "
                    f"embedding {emb} NOT NULL, version BIGINT NOT NULL, op SMALLINT NOT NULL) "
                    "ON COMMIT DELETE ROWS"
                )
        self._conn = conn
        return conn

    @contextmanager
    def _tx(self, write: bool = True) -> Iterator[Any]:
        """A transaction; nested in another one of this store's, a savepoint (psycopg's rule)."""
        with self._lock, _ERRORS.map_errors(self.describe()):
            conn = self._connect()
            try:
                with conn.transaction(), conn.cursor() as cur:
                    yield cur
            except psycopg.Error as e:
                if _ERRORS.transient(e) or conn.closed or conn.broken:
                    self._drop_connection()  # the next call reconnects
                raise

    def _drop_connection(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None

    def _create_registry(self) -> None:
        with self._tx() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (_DDL_LOCK,))
            self._create_registry_in(cur)

    def _columns(self, cur: Any, table: str) -> set[str]:
        cur.execute(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_schema = current_schema() AND table_name = %s",
            (table,),
        )
        return {str(c) for (c,) in cur.fetchall()}

    def close(self) -> None:
        """Close the connection (idempotent)."""
        with self._lock:
            self._closed = True
            self._drop_connection()

    def _sql(self, sql: str) -> str:
        return sql.replace("?", "%s")

    # ---- DDL -----------------------------------------------------------------------------
    def _check_layout(self, table: str, spec: TableSpec) -> None:
        if self.layout == "float4[]" and DType(spec.dtype) is DType.INT8_ROWWISE:
            raise ConfigError(
                f"table {table!r} is int8_rowwise; the float4[] layout holds float32/float16 "
                "tables only (use layout=bytea)"
            )

    def provision(
        self, tables: Mapping[str, TableSpec], staging_generation: int | None = None
    ) -> dict[str, ViewInfo]:
        """See :meth:`Store.provision` (serialized with other ranks by an advisory lock)."""
        with self._lock, self._tx() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (_DDL_LOCK,))
            # super()'s transaction nests in this one as a savepoint: its DDL commits with
            # this transaction, under the lock, which is held until then.
            return super().provision(tables, staging_generation)

    def _lock_run(self, cur: Any, run: str, shared: bool) -> None:
        """Advisory lock per run: a registration waits for in-flight writes' commits."""
        key = int.from_bytes(hashlib.sha256(f"deltarec-run:{run}".encode()).digest()[:8], "big")
        key -= 1 << 63 if key >= 1 << 63 else 0
        fn = "pg_advisory_xact_lock_shared" if shared else "pg_advisory_xact_lock"
        cur.execute(f"SELECT {fn}(%s)", (key,))

    def _create_view_sql(self, name: str, spec: TableSpec, staging: bool) -> list[str]:
        emb = "BYTEA" if self.layout == "bytea" else "REAL[]"
        op = ", op SMALLINT NOT NULL" if staging else ""
        fill = "" if staging else f" WITH (fillfactor = {FILLFACTOR})"
        return [
            f"CREATE TABLE IF NOT EXISTS {quote(name)} (key BIGINT PRIMARY KEY, "
            f"embedding {emb} NOT NULL, version BIGINT NOT NULL, "
            f"updated_at TIMESTAMPTZ NOT NULL DEFAULT now(){op}){fill}"
        ]

    # ---- rows ----------------------------------------------------------------------------
    def apply(self, write: Write) -> int:
        """See :meth:`Store.apply`: one transaction, rows copied, then one merge.

        Each batch is sorted by key. Rows of keys the view does not hold yet are copied
        straight into it (see :func:`~deltarec.stores.sql.pgload.copy_direct`); the others go
        through the batch table and one versioned merge, which reads them in key order (an
        ``ORDER BY`` only where they did not come in key order), so the view's index is walked,
        not probed at random.
        """
        table, batches, mark, staging_generation = write
        self._check_mark(mark)
        stage = int(staging_generation or 0)
        view = self._view(table, stage)
        lowest = LowestVersion(batches)
        first, it = first_batch(table, lowest)
        with self._tx() as cur:
            # The share lock holds off a snapshot sweep (which raises the floor) until commit.
            floor, tombstones = self._view_state(cur, view.name, " FOR SHARE")
            sent = Sent()
            rows = sorted_rows(table, view, itertools.chain([first], it), sent)
            # Straight in only on PostgreSQL 15+ (as MERGE): wire-compatible stores that
            # report older versions get the plain path, without savepoints.
            direct = self._has_merge(cur) and (bool(stage) or not tombstones)
            copy_rows(cur, view, self.layout, rows, floor, direct, sent)
            if sent.deletes and not stage and not tombstones:
                # The first tombstones of a view. Two writers doing this at once each wait for
                # the other's share lock: PostgreSQL aborts one (a deadlock, transient), and the
                # publisher retries it.
                cur.execute(
                    "UPDATE deltarec_views SET has_tombstones = 1 "
                    "WHERE name = %s AND has_tombstones = 0",
                    (view.name,),
                )
                tombstones = True
            if sent.staged:
                source = BATCH_TABLES[self.layout]
                if stage:
                    sort = not sent.in_order and not self._cached(cur, view.name)
                    self._merge_into_stage(cur, view, floor, sort)
                else:
                    walk = self._walks(cur, view.name, source)
                    if walk:  # both sides read in key order through an index (see _WALK)
                        cur.execute(f"CREATE INDEX {source}_key ON {source} (key)")
                    sort = not (walk or sent.in_order or self._cached(cur, view.name))
                    self._merge_batch(cur, view.name, source, floor, tombstones, sort, walk)
                    if sent.deletes:
                        self._apply_deletes(cur, view.name, source, floor)
                    if walk:  # the next write's COPY goes faster without it
                        cur.execute(f"DROP INDEX {source}_key")
            if mark is not None:
                self._write_mark(cur, mark, stage)
            self._lower_low_mark(cur, view, lowest)
        return sent.rows

    @staticmethod
    def _cached(cur: Any, name: str) -> bool:
        """Whether the view (table and index) fits in the server's buffer cache.

        Then the merge reads the batch table as it was copied (each batch in key order):
        walking the view in key order saves page reads only where pages are read from disk,
        and sorting a large batch table costs about a second per million rows of dim 64.
        Servers that report versions before 15 (wire-compatible stores among them) are not
        asked: False.
        """
        if not PostgresStore._has_merge(cur):
            return False
        cur.execute(
            "SELECT pg_total_relation_size(%s::regclass) "
            "< pg_size_bytes(current_setting('shared_buffers'))",
            (quote(name),),
        )
        return bool(cur.fetchone()[0])

    @staticmethod
    def _walks(cur: Any, name: str, source: str) -> bool:
        """Whether to merge ``source`` into view ``name`` by a merge join (see :data:`_WALK`).

        Only where the server has ``MERGE``, and ``source`` is at least
        :data:`_WALK_MIN_BYTES`; the sizes are those of the tables' files.
        """
        if not PostgresStore._has_merge(cur):
            return False
        cur.execute(
            "SELECT pg_relation_size(%s::regclass) AS s, pg_relation_size(%s::regclass) AS v",
            (source, quote(name)),
        )
        source_bytes, view_bytes = cur.fetchone()
        return bool(source_bytes >= _WALK_MIN_BYTES and source_bytes * _WALK >= view_bytes)

    def _merge_batch(
        self,
        cur: Any,
        name: str,
        source: str,
        floor: int,
        tombstones: bool,
        sort: bool = True,
        walk: bool = False,
    ) -> int:
        """Versioned upsert of ``source``'s rows; ``sort=False`` when they are in key order.

        Where the server has ``MERGE`` (PostgreSQL 15+), a ``MERGE`` applies new keys as plain
        inserts, 1.2-2x faster than ``INSERT ... ON CONFLICT``, whose every insert is a
        speculative one. It finds each row's key in the view by a nested loop over the view's
        index (the rows are not hashed), or with ``walk`` (``source`` has an index on ``key``)
        by a merge join: both indexes read once in key order, no descent of the view's index
        per row. ``MERGE`` is not safe against another session inserting one of the same new
        keys at the same time: that fails it with a unique violation, and the rows are then
        applied with ``INSERT ... ON CONFLICT`` in the same transaction instead.
        """
        q = quote(name)
        order = " ORDER BY s.key" if sort and not walk else ""
        guard = ""
        params: tuple[Any, ...] = (floor,)
        if tombstones:
            guard = (
                " AND NOT EXISTS (SELECT 1 FROM deltarec_tombstones t WHERE t.name = %s"
                " AND t.key = s.key AND t.version > s.version)"
            )
            params = (floor, name)
        rows = f"SELECT s.* FROM {source} s WHERE s.op = 0 AND s.version >= %s{guard}{order}"
        if self._has_merge(cur):
            off = ("hashjoin", "nestloop", "sort") if walk else ("hashjoin", "mergejoin")
            for plan in off:
                cur.execute(f"SET LOCAL enable_{plan} = off")
            try:
                with cur.connection.transaction():  # a savepoint
                    cur.execute(
                        f"MERGE INTO {q} AS v USING ({rows}) AS s ON v.key = s.key "
                        "WHEN MATCHED AND v.version <= s.version THEN UPDATE SET "
                        "embedding = s.embedding, version = s.version, updated_at = now() "
                        "WHEN NOT MATCHED THEN INSERT (key, embedding, version, updated_at) "
                        "VALUES (s.key, s.embedding, s.version, now())",
                        params,
                    )
                    return int(cur.rowcount)
            except pgerrors.UniqueViolation:
                pass  # a concurrent writer inserted one of these keys first
        cur.execute(
            f"INSERT INTO {q} AS v (key, embedding, version, updated_at) "
            f"SELECT s.key, s.embedding, s.version, now() FROM ({rows}) AS s "
            "ON CONFLICT (key) DO UPDATE SET embedding = EXCLUDED.embedding, "
            "version = EXCLUDED.version, updated_at = EXCLUDED.updated_at "
            "WHERE v.version <= EXCLUDED.version",
            params,
        )
        return int(cur.rowcount)

    @staticmethod
    def _has_merge(cur: Any) -> bool:
        """Whether the server has ``MERGE`` (PostgreSQL 15+; wire-compatible stores may not)."""
        return int(cur.connection.info.server_version) >= 150000

    @staticmethod
    def _apply_deletes(cur: Any, name: str, source: str, floor: int) -> int:
        q = quote(name)
        cur.execute(
            f"DELETE FROM {q} v USING {source} s WHERE s.op = 1 AND s.version >= %s "
            "AND v.key = s.key AND v.version <= s.version",
            (floor,),
        )
        cur.execute(
            "INSERT INTO deltarec_tombstones AS t (name, key, version) "
            f"SELECT %s, s.key, s.version FROM {source} s WHERE s.op = 1 AND s.version >= %s "
            "ON CONFLICT (name, key) DO UPDATE SET version = EXCLUDED.version "
            "WHERE t.version < EXCLUDED.version",
            (name, floor),
        )
        return int(cur.rowcount)

    def _merge_into_stage(self, cur: Any, view: ViewInfo, floor: int, sort: bool) -> None:
        q = quote(view.name)
        order = " ORDER BY s.key" if sort else ""
        cur.execute(
            f"INSERT INTO {q} AS v (key, embedding, version, updated_at, op) "
            f"SELECT s.key, s.embedding, s.version, now(), s.op FROM {BATCH_TABLES[self.layout]} s "
            f"WHERE s.version >= %s{order} ON CONFLICT (key) DO UPDATE SET "
            "embedding = EXCLUDED.embedding, version = EXCLUDED.version, "
            "updated_at = EXCLUDED.updated_at, op = EXCLUDED.op "
            "WHERE v.version <= EXCLUDED.version",
            (floor,),
        )

    def _keys_in(self, keys: list[int]) -> tuple[str, Sequence[Any]]:
        return "key = ANY(?)", (keys,)

    def _decode(self, value: Any, view: ViewInfo, element: np.dtype) -> np.ndarray:
        if self.layout == "bytea":
            return np.frombuffer(value, dtype=element)
        return decode_float4_array(value, view.dim).astype(element)

    def scan_rows(
        self, table: str, batch_rows: int = 65536
    ) -> Iterator[tuple[np.ndarray, ReadResult]]:
        """Every row of a live view once, in pages of about ``batch_rows`` rows, in no key order.

        On PostgreSQL 14+ a page is a range of the view's heap blocks (a TID range scan: no
        index, no sort), every page read in one ``REPEATABLE READ`` snapshot on a connection
        of the scan's own, so a row that moves while the scan runs still comes once, and the
        store's connection stays free for other calls. Elsewhere (wire-compatible stores that
        report older versions) keyset pages by key, one read transaction each. Each page comes
        back as one value: the server concatenates the page's rows into one ``bytea`` of
        fixed-width records (key, version, embedding; see :func:`_page_sql`), sent in binary,
        which numpy decodes at once, instead of a Python tuple per row.

        Raises:
            StoreError: a stored row is not of the view's width (names the view).
        """
        view = self._view(table)
        records = _page_records(view, self.layout)
        with _ERRORS.map_errors(self.describe()):
            conn = psycopg.connect(autocommit=True, **self.connect_params())
        try:
            with _ERRORS.map_errors(self.describe()):
                conn.execute(f"SET search_path TO {quote(self.config.schema_name)}")
                conn.execute("SET jit = off")
                by_blocks = int(conn.info.server_version) >= _BLOCK_SCANS
                if by_blocks:
                    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            pages = _block_pages if by_blocks else _key_pages
            with _ERRORS.map_errors(self.describe()):
                for blob, n in pages(conn, view.name, self.layout, records.itemsize, batch_rows):
                    yield self._page(view, records, blob, n)
        finally:
            conn.close()

    def _page(
        self, view: ViewInfo, records: np.dtype, blob: bytes, n: int
    ) -> tuple[np.ndarray, ReadResult]:
        """One page of :func:`_page_sql` decoded (see :meth:`scan_rows`)."""
        page = np.frombuffer(blob, records) if len(blob) == n * records.itemsize else None
        emb = None if page is None else _page_rows(page, view, self.layout)
        if page is None or emb is None:
            raise StoreError(
                f"{self.describe()}: view {view.name!r} holds rows that are not "
                f"{view.describe()} layout={self.layout}"
            )
        return page["k"].astype(np.int64), ReadResult(
            np.ones(n, bool), page["v"].astype(np.int64), emb
        )

    # ---- snapshot / staging --------------------------------------------------------------
    def _merge_view(self, cur: Any, stage: ViewInfo, live: ViewInfo) -> int:
        cur.execute(
            "UPDATE deltarec_views SET has_tombstones = 1 WHERE name = %s AND has_tombstones = 0 "
            f"AND EXISTS (SELECT 1 FROM {quote(stage.name)} WHERE op = 1)",
            (live.name,),
        )
        floor, tombstones = self._view_state(cur, live.name, " FOR UPDATE")
        source = quote(stage.name)  # its primary key is the index a merge join walks
        walk = self._walks(cur, live.name, source)
        merged = self._merge_batch(cur, live.name, source, floor, tombstones, walk=walk)
        return merged + self._apply_deletes(cur, live.name, quote(stage.name), floor)

    def merge_staging(self, run: str, generation: int) -> int:
        """See :meth:`Store.merge_staging` (one transaction, serialized by an advisory lock)."""
        with self._lock, self._tx() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (_DDL_LOCK,))
            # super() lists the staging views under the lock (a merge that waited finds them
            # gone) and its transaction nests in this one as a savepoint: one commit.
            return super().merge_staging(run, generation)


def _page_sql(name: str, layout: str, where: str, limit: str = "") -> str:
    """One page of view ``name`` as ``(rows, records)``.

    ``where`` is the page's condition, ``limit`` a keyset page's ``ORDER BY ... LIMIT``. The
    records are one ``bytea``: per row, in no particular order, the key and the version
    (``int8send``, big-endian) and the embedding (``bytea``: as stored; ``float4[]``:
    ``array_send``, the binary array format that :func:`~deltarec.stores.sql.pgcopy.embedding_field`
    writes).
    """
    emb = "embedding" if layout == "bytea" else "array_send(embedding)"
    return (
        f"SELECT count(*), string_agg(int8send(key) || int8send(version) || {emb}, ''::bytea) "
        f"FROM (SELECT key, version, embedding FROM {quote(name)} WHERE {where}{limit}) AS page"
    )


_BLOCK_SCANS = 140000
"""The first server version with TID range scans (PostgreSQL 14), which block pages need."""
_SCAN_BLOCKS_MAX = 8192
"""Most heap blocks (8 kB each) in one page of a block-range scan."""


def _block_pages(
    conn: Any, name: str, layout: str, width: int, batch_rows: int
) -> Iterator[tuple[bytes, int]]:
    """Pages of view ``name`` by ranges of its heap blocks, ``(records, rows)`` each.

    Each range is sized from the rows per block seen so far (first as if blocks were full);
    the last one is open-ended, for blocks added since the scan's first page.
    """
    with conn.cursor() as cur:
        cur.execute(
            "SELECT pg_relation_size(%s::regclass) / current_setting('block_size')::bigint",
            (quote(name),),
        )
        blocks = int(cur.fetchone()[0])
        step = max(1, min(_SCAN_BLOCKS_MAX, batch_rows * (width + 32) // 8192))
        at = 0
        while True:
            last = at >= blocks
            where = "ctid >= %s::tid" + ("" if last else " AND ctid < %s::tid")
            params = [f"({at},0)"] if last else [f"({at},0)", f"({at + step},0)"]
            cur.execute(_page_sql(name, layout, where), params, binary=True)
            n, blob = cur.fetchone()
            if n:
                yield blob, int(n)
            if last:
                return
            at += step
            step = max(1, min(_SCAN_BLOCKS_MAX, 4 * step, step * batch_rows // max(1, int(n))))


def _key_pages(
    conn: Any, name: str, layout: str, width: int, batch_rows: int
) -> Iterator[tuple[bytes, int]]:
    """Keyset pages of view ``name``, ``(records, rows)`` each, one transaction per page."""
    last: int | None = None
    with conn.cursor() as cur:
        while True:
            where = "true" if last is None else "key > %s"
            params = [batch_rows] if last is None else [last, batch_rows]
            sql = _page_sql(name, layout, where, " ORDER BY key LIMIT %s")
            cur.execute(sql, params, binary=True)
            n, blob = cur.fetchone()
            if not n:
                return
            yield blob, int(n)
            if n < batch_rows:
                return
            # the page's largest key (records: big-endian key first)
            keys = np.frombuffer(blob, np.dtype([("k", ">i8"), ("x", np.void, width - 8)]))
            last = int(keys["k"].max())


def _page_records(view: ViewInfo, layout: str) -> np.dtype:
    """The numpy record of one row of :func:`_page_sql` for ``view``."""
    if layout == "bytea":
        width = codec.encoded_width(view.dtype, view.dim)
        emb: list[Any] = [("e", codec.element_type(view.dtype), (width,))]
    else:
        emb = [("h", ">i4", (5,)), ("e", [("l", ">i4"), ("x", ">f4")], (view.dim,))]
    return np.dtype([("k", ">i8"), ("v", ">i8"), *emb])


def _page_rows(page: np.ndarray, view: ViewInfo, layout: str) -> np.ndarray | None:
    """The encoded rows of a page of :func:`_page_records`.

    None if an array of the ``float4[]`` layout is not a plain one of ``dim`` values.
    """
    if layout == "bytea":
        return np.ascontiguousarray(page["e"])
    if not ((page["h"] == (1, 0, FLOAT4_OID, view.dim, 1)).all() and (page["e"]["l"] == 4).all()):
        return None
    return page["e"]["x"].astype(codec.element_type(view.dtype))
