"""SQLite: the embedded default store, one file, zero setup (SPEC §5).

Each view is a table ``key INTEGER PRIMARY KEY, embedding BLOB, version INTEGER NOT NULL,
updated_at REAL`` (BLOB = the encoded row, packed little-endian in the table's dtype), so an
outside reader gets a row with ``SELECT embedding FROM emb_sparse_ebc_user_id WHERE key = ?``.
A batch is one ``BEGIN IMMEDIATE`` transaction holding its rows and its progress mark; the
database runs in WAL mode so readers never block the writer. Staging views carry an extra
``op`` column: a delete is staged as a row and applied by :meth:`SqliteStore.merge_staging`.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any

import numpy as np

from deltarec.artifacts import codec
from deltarec.artifacts.types import DType, TableSpec
from deltarec.errors import StoreError
from deltarec.stores.base import first_batch
from deltarec.stores.config import SqliteConfig
from deltarec.stores.errors import DriverErrors
from deltarec.stores.naming import quote
from deltarec.stores.rows import ascending, checked_arrays
from deltarec.stores.sql.relational import LowestVersion, RelationalStore
from deltarec.stores.sql.spill import Spill
from deltarec.stores.sql.upsert import insert_rows, json_rows, upsert_sql, version_sql
from deltarec.stores.sql.writebehind import WriteBehind
from deltarec.stores.types import ProgressMark, ReadResult, RowBatch, ViewInfo, Write


def _transient(e: BaseException) -> bool:
    """A database another connection holds locked or busy: a later try may get it."""
    text = str(e)
    return isinstance(e, sqlite3.OperationalError) and ("locked" in text or "busy" in text)


_ERRORS = DriverErrors(sqlite3.Error, _transient)
"""SQLite's errors as the store contract's (see :mod:`deltarec.stores.errors`)."""

PAGE_SIZE = 16384
"""Page size of a new store file. A batch in random key order rewrites every page it touches
into the WAL; 16 KB pages hold ~56 rows of dim 64 float32 and make bulk upserts ~1.5-2x faster
than 4 KB pages (fewer B-tree pages to split, search and write). ``checkpoint_pages`` counts
4 KB units, so the WAL checkpoint interval in bytes does not depend on the page size."""


class SqliteStore(RelationalStore):
    """The SQLite backend. Safe to share between threads (one lock around the connection).

    Args:
        config: the parsed ``sqlite:///path`` URL.
        registry_of: see :attr:`RelationalStore.registry_of`.
    """

    kind = "sqlite"
    capabilities = dataclasses.replace(RelationalStore.capabilities, parts_together=True)
    _read_chunk = 500  # keys per SELECT ... IN (...); below SQLite's parameter limit
    _registry_unit = "file"

    def __init__(self, config: SqliteConfig, registry_of: str | None = None) -> None:
        self.config = config
        self.registry_of = registry_of
        self.prefix = config.prefix
        self._lock = threading.RLock()
        self._views_cache: dict[tuple[str, int], ViewInfo] = {}
        path = config.path
        syncs = path != ":memory:" and config.synchronous != "OFF"
        self._behind = WriteBehind(path) if syncs else None
        if path != ":memory:":
            parent = os.path.dirname(os.path.abspath(path))
            os.makedirs(parent, exist_ok=True)
        # A file another process holds locked is a transient error (see _transient).
        with _ERRORS.map_errors(f"sqlite store {path!r}: cannot open"):
            self._conn: sqlite3.Connection | None = sqlite3.connect(
                path, timeout=config.timeout_s, isolation_level=None, check_same_thread=False
            )
        try:
            self._open(path)
        except BaseException:
            self.close()  # a refused open leaves no connection (nor file lock) behind
            raise

    def _open(self, path: str) -> None:
        """Set the new connection up and create the registry (see :meth:`__init__`)."""
        assert self._conn is not None
        config = self.config
        with _ERRORS.map_errors(f"sqlite store {path!r}: cannot open"):
            self._conn.execute(f"PRAGMA page_size = {PAGE_SIZE}")  # a new file only
            # Switching to WAL needs the file to itself and may answer "locked" at once, without
            # waiting: only the file's first opener switches (WAL is kept in the file).
            mode = self._conn.execute("PRAGMA journal_mode").fetchone()[0]
            if str(mode).lower() != "wal":
                self._conn.execute("PRAGMA journal_mode = WAL")
            self._conn.execute(f"PRAGMA synchronous = {config.synchronous}")
            self._conn.execute(f"PRAGMA cache_size = {-1024 * config.cache_mb}")
            page = int(self._conn.execute("PRAGMA page_size").fetchone()[0])
            checkpoint = max(1, config.checkpoint_pages * 4096 // page)  # same WAL bytes
            self._conn.execute(f"PRAGMA wal_autocheckpoint = {checkpoint}")
        try:
            self._conn.execute("SELECT count(*) FROM json_each('[1]')")
        except sqlite3.OperationalError as e:
            raise StoreError(
                f"sqlite store {path!r}: this SQLite ({sqlite3.sqlite_version}) has no JSON "
                f"functions ({e}); deltarec needs SQLite 3.38+ or a build with JSON1"
            ) from e
        self._create_registry()

    def describe(self) -> str:
        """``sqlite:///<path>``."""
        return f"sqlite:///{self.config.path}"

    def _registry_place(self) -> str:
        return f"file {self.config.path!r}"

    def place(self) -> str:
        """See :meth:`Store.place`: the file's resolved absolute path (links followed), prefix."""
        path = self.config.path
        where = path if path == ":memory:" else os.path.realpath(path)
        return f"sqlite://{where}?prefix={self.prefix}"

    # ---- connection ----------------------------------------------------------------------
    @contextmanager
    def _tx(self, write: bool = True, bulk: bool = False) -> Iterator[Any]:
        """A transaction (``write``: ``BEGIN IMMEDIATE``).

        ``bulk``: a long write, whose WAL is synced while it runs
        (:class:`~deltarec.stores.sql.writebehind.WriteBehind`), unless the store syncs nothing.
        """
        behind = self._behind if bulk else None
        with (
            self._lock,
            _ERRORS.map_errors(self.describe()),
            behind.writing() if behind is not None else nullcontext() as flushing,
        ):
            if self._conn is None:
                raise StoreError(f"{self.describe()} is closed")
            cur = self._conn.cursor()
            try:
                cur.execute("BEGIN IMMEDIATE" if write else "BEGIN")
                yield cur
                if flushing is not None:
                    flushing.committing()
                cur.execute("COMMIT")
            except BaseException:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise
            finally:
                cur.close()

    def close(self) -> None:
        """Close the connection (idempotent)."""
        with self._lock:
            if self._behind is not None:
                self._behind.close()
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    # ---- DDL -----------------------------------------------------------------------------
    def _columns(self, cur: Any, table: str) -> set[str]:
        return {str(row[1]) for row in cur.execute(f"PRAGMA table_info({quote(table)})")}

    def _create_view_sql(self, name: str, spec: TableSpec, staging: bool) -> list[str]:
        op = ", op INTEGER NOT NULL" if staging else ""
        return [
            f"CREATE TABLE IF NOT EXISTS {quote(name)} (key INTEGER PRIMARY KEY, "
            f"embedding BLOB NOT NULL, version INTEGER NOT NULL, updated_at REAL NOT NULL{op})"
        ]

    # ---- rows ----------------------------------------------------------------------------
    def apply(self, write: Write) -> int:
        """See :meth:`Store.apply`: one ``BEGIN IMMEDIATE`` transaction.

        A single batch is sorted and applied at once. Of several, those that come in key order
        (each sorted and after the one before, as a dump of a plain table is) are applied as
        they come; from the first that is not, the rest wait in a spill file
        (:class:`~deltarec.stores.sql.spill.Spill`, each batch sorted) and are applied in one
        key-ordered pass at the end.
        """
        table, batches, mark, staging_generation = write
        marks = [] if mark is None else [mark]
        return self.write_parts(table, batches, marks, staging_generation)

    def write_parts(
        self,
        table: str,
        batches: Iterable[RowBatch],
        marks: Sequence[ProgressMark],
        staging_generation: int | None = None,
        before_commit: Callable[[], None] | None = None,
    ) -> int:
        """:meth:`write_batches` of several parts' rows, with every part's mark, in one transaction.

        The rows of several ranks' parts of one dump, one after the other: in one key-ordered
        pass their B-tree pages are written once, where part after part would insert each
        rank's keys between the previous ones' (every page split and written again). A key
        in two parts is applied in the order the rows come, as part after part would.
        ``before_commit`` runs last inside the transaction; what it raises rolls it back (the
        publisher waits there for the checksums of the shards it read).
        """
        self._check_mark(None)  # the handle must have a run, with or without marks
        for mark in marks:
            self._check_mark(mark)
        stage = int(staging_generation or 0)
        view = self._view(table, stage)
        lowest = LowestVersion(batches)
        first, it = first_batch(table, lowest)
        now = time.time()
        with self._tx(bulk=True) as cur:
            floor, tombstones = self._view_state(cur, view.name)
            second = next(it, None)
            if second is None:
                n, _ = self._write_one(cur, table, view, first, floor, tombstones, now, True)
            else:
                rest = itertools.chain([first, second], it)
                n = self._write_many(cur, table, view, rest, floor, tombstones, now)
            self._write_marks(cur, marks, stage)  # one statement for every part's mark
            self._lower_low_mark(cur, view, lowest)
            if before_commit is not None:
                before_commit()
        return n

    def _write_one(
        self,
        cur: sqlite3.Cursor,
        table: str,
        view: ViewInfo,
        batch: RowBatch,
        floor: int,
        tombstones: bool,
        now: float,
        sort: bool,
    ) -> tuple[int, bool]:
        """Apply one batch (``sort``: put it in key order first); ``(rows, tombstones)``."""
        keys, ops, versions = checked_arrays(table, view, *batch)
        keep = versions >= floor
        tombstones = self._apply(
            cur, view, keys, batch.embedding, versions, ops, keep, tombstones, now, sort
        )
        return int(keys.shape[0]), tombstones

    def _apply(
        self,
        cur: sqlite3.Cursor,
        view: ViewInfo,
        keys: np.ndarray,
        embedding: np.ndarray,
        versions: np.ndarray,
        ops: np.ndarray,
        keep: np.ndarray | None,
        tombstones: bool,
        now: float,
        sort: bool,
    ) -> bool:
        """Apply checked rows (those ``keep`` marks; None: all): upserts, then deletes.

        Returns whether the view has tombstones now.
        """
        if view.staging_generation:

            def staged(per_row: bool) -> str:
                return upsert_sql(view.name, json_rows(True, per_row), "", "", False, with_op=True)

            picked = None if keep is None or keep.all() else np.flatnonzero(keep)
            insert_rows(cur, staged, keys, embedding, versions, ops, now, sort, picked)
            return tombstones
        dels = ops == 1 if keep is None else keep & (ops == 1)
        if dels.any():
            tombstones = self._note_tombstones(cur, view, tombstones)
        up = ops == 0 if keep is None else keep & (ops == 0)
        picked = None if up.all() else np.flatnonzero(up)  # indices, not copies of the rows

        def live(per_row: bool) -> str:
            source = json_rows(False, per_row)
            return upsert_sql(view.name, source, "j.value", version_sql(per_row), tombstones)

        insert_rows(cur, live, keys, embedding, versions, None, now, sort, picked)
        if dels.any():
            self._delete(cur, view.name, keys[dels].tolist(), versions[dels].tolist())
        return tombstones

    def _write_many(
        self,
        cur: sqlite3.Cursor,
        table: str,
        view: ViewInfo,
        batches: Iterable[RowBatch],
        floor: int,
        tombstones: bool,
        now: float,
    ) -> int:
        n, last = 0, None
        with ExitStack() as stack:
            spill: Spill | None = None
            for batch in batches:
                keys = np.asarray(batch.keys)
                if spill is None and _follows(keys, last):
                    count, tombstones = self._write_one(
                        cur, table, view, batch, floor, tombstones, now, False
                    )
                    n += count
                    last = int(keys[-1]) if len(keys) else last
                    continue
                if spill is None:
                    spill = stack.enter_context(Spill())
                keys, ops, versions = checked_arrays(table, view, *batch)
                n += int(keys.shape[0])
                keep = versions >= floor
                spill.add(keys, batch.embedding, versions, ops, None if keep.all() else keep)
            if spill is not None:
                # In key order, a later batch after an earlier one for the same key (as the
                # batches came). A key's rows may straddle two read chunks: the version guard
                # and the tombstones make the outcome the same as in one.
                # Read back on a thread, a chunk ahead of the statements.
                for rows in stack.enter_context(spill.rows_ahead()):
                    tombstones = self._apply(cur, view, *rows, None, tombstones, now, False)
        return n

    def _note_tombstones(self, cur: sqlite3.Cursor, view: ViewInfo, tombstones: bool) -> bool:
        """Mark ``view`` as holding tombstones (its upserts check them from now on)."""
        if not tombstones:
            cur.execute("UPDATE deltarec_views SET has_tombstones = 1 WHERE name = ?", (view.name,))
        return True

    @staticmethod
    def _delete(cur: sqlite3.Cursor, name: str, keys: list[int], versions: list[int]) -> None:
        pairs = list(zip(keys, versions, strict=True))
        cur.executemany(f"DELETE FROM {quote(name)} WHERE key = ? AND version <= ?", pairs)
        cur.executemany(
            "INSERT INTO deltarec_tombstones (name, key, version) VALUES (?, ?, ?) "
            "ON CONFLICT (name, key) DO UPDATE SET version = excluded.version "
            "WHERE excluded.version > deltarec_tombstones.version",
            [(name, k, v) for k, v in pairs],
        )

    def scan_rows(
        self, table: str, batch_rows: int = 65536
    ) -> Iterator[tuple[np.ndarray, ReadResult]]:
        """See :meth:`Store.scan_rows`: one ordered scan, keyset-paged, ascending by key.

        Each page of ``batch_rows`` rows is fetched as one aggregate row (SQLite concatenates
        the page's blobs), instead of one Python tuple, int and bytes object per row: most of
        the cost of a plain ``SELECT`` in Python. A page whose keys are one run ``lo..hi`` (the
        key is the unique rowid, so ``count = hi - lo + 1`` proves it) and whose rows share one
        version needs nothing else. Other pages list their keys and versions as decimal text,
        concatenated by the same aggregate step as the blobs, so keys and rows pair up
        whatever order SQLite visits them in. A page is read as a run first while the pages
        before it were runs, and listed first otherwise; a run page that turns out otherwise
        is listed again in the same read transaction.

        Raises:
            StoreError: a row's blob is not one encoded row long (a corrupted view).
        """
        view = self._view(table)
        width = codec.encoded_width(view.dtype, view.dim)
        element = codec.element_type(view.dtype)
        start, listed = -(1 << 63), False
        while True:
            with self._tx(write=False) as cur:
                page = None if listed else self._run_page(cur, view, start, batch_rows)
                if page is None:
                    page = self._listed_page(cur, view, start, batch_rows)
            if page is _EMPTY:
                return
            keys, versions, blob = page
            n = len(keys)
            listed = not _one_run(keys, versions)
            yield (
                keys,
                ReadResult(
                    np.ones(n, bool), versions, np.frombuffer(blob, element).reshape(n, width)
                ),
            )
            if n < batch_rows or keys.max() == (1 << 63) - 1:
                return
            start = int(keys.max()) + 1

    def _run_page(
        self, cur: Any, view: ViewInfo, start: int, limit: int
    ) -> tuple[np.ndarray, np.ndarray, bytes] | None:
        """The page from ``start`` if its keys are one run at one version, else None."""
        cur.execute(
            "SELECT count(*), min(key), max(key), min(version), max(version), "
            "max(length(embedding)), "
            f"CAST(group_concat(embedding, '') AS BLOB) FROM ({_page_sql(view)})",
            (start, limit),
        )
        n, lo, hi, v_lo, v_hi, longest, blob = cur.fetchone()
        if not n:
            return _EMPTY
        self._check_lengths(view, n, longest, len(blob), lo, hi)
        if hi - lo + 1 != n or v_lo != v_hi:
            return None
        return np.arange(lo, hi + 1, dtype=np.int64), np.full(n, v_lo, np.int64), blob

    def _listed_page(
        self, cur: Any, view: ViewInfo, start: int, limit: int
    ) -> tuple[np.ndarray, np.ndarray, bytes]:
        """The page from ``start`` with every key and version.

        Keys and versions come as two comma-separated decimal lists, concatenated by the same
        aggregate step as the blobs (so they pair up whatever order SQLite visits the rows
        in) and parsed by numpy in C: about half the cost of a ``printf`` per row.
        """
        cur.execute(
            "SELECT count(*), min(key), max(key), max(length(embedding)), "
            "group_concat(key, ','), group_concat(version, ','), "
            f"CAST(group_concat(embedding, '') AS BLOB) FROM ({_page_sql(view)})",
            (start, limit),
        )
        n, lo, hi, longest, keys, versions, blob = cur.fetchone()
        if not n:
            return _EMPTY
        self._check_lengths(view, n, longest, len(blob), lo, hi)
        return _integers(keys, n), _integers(versions, n), blob

    def _check_lengths(
        self, view: ViewInfo, n: int, longest: int, total: int, lo: int, hi: int
    ) -> None:
        """Every blob of a page is one encoded row: none longer, and all of them together n rows.

        (No blob over ``size`` bytes and ``n * size`` bytes in all leave no blob shorter.)
        """
        size = codec.row_bytes(view.dtype, view.dim)
        if longest != size or total != n * size:
            kind = f"{DType(view.dtype).value} rows of dim {view.dim}"
            raise StoreError(
                f"{self.describe()}: view {view.name!r} holds rows that are not {size} bytes "
                f"({kind}) between keys {lo} and {hi}: {n} rows of {total} bytes in all, the "
                f"longest {longest}"
            )

    # ---- snapshot / staging --------------------------------------------------------------
    def _merge_view(self, cur: Any, stage: ViewInfo, live: ViewInfo) -> int:
        s, q = quote(stage.name), quote(live.name)
        floor, _ = self._view_state(cur, live.name)
        cur.execute(f"SELECT COUNT(*) FROM {s} WHERE op = 1 AND version >= ?", (floor,))
        if cur.fetchone()[0]:
            cur.execute("UPDATE deltarec_views SET has_tombstones = 1 WHERE name = ?", (live.name,))
        cur.execute(
            f"INSERT INTO {q} (key, embedding, version, updated_at) "
            f"SELECT s.key, s.embedding, s.version, s.updated_at FROM {s} s "
            "WHERE s.op = 0 AND s.version >= ? AND NOT EXISTS (SELECT 1 FROM deltarec_tombstones t"
            " WHERE t.name = ? AND t.key = s.key AND t.version > s.version) "
            "ON CONFLICT (key) DO UPDATE SET embedding = excluded.embedding, "
            f"version = excluded.version, updated_at = excluded.updated_at "
            f"WHERE excluded.version >= {q}.version",
            (floor, live.name),
        )
        merged = int(cur.rowcount)
        cur.execute(f"SELECT key, version FROM {s} WHERE op = 1 AND version >= ?", (floor,))
        deletes = cur.fetchall()
        if deletes:
            self._delete(cur, live.name, [k for k, _ in deletes], [v for _, v in deletes])
        return merged + len(deletes)


_EMPTY = (np.empty(0, np.int64), np.empty(0, np.int64), b"")
"""A page past the last row."""


def _page_sql(view: ViewInfo) -> str:
    """Up to ``?2`` rows of ``view`` from key ``?1`` on, in key order."""
    return (
        f"SELECT key, embedding, version FROM {quote(view.name)} WHERE key >= ?1 "
        "ORDER BY key LIMIT ?2"
    )


def _integers(text: str, n: int) -> np.ndarray:
    """``n`` int64 values from SQLite's comma-separated decimal list ``text``."""
    values = np.fromstring(text, dtype=np.int64, sep=",")  # text mode: exact int64 parsing
    if values.shape != (n,):
        raise StoreError(f"a listed page held {values.shape[0]} values where {n} were expected")
    return values


def _one_run(keys: np.ndarray, versions: np.ndarray) -> bool:
    """Whether sorted unique ``keys`` are ``lo..hi`` at one version."""
    n = len(keys)
    return n > 0 and int(keys[-1]) - int(keys[0]) + 1 == n and bool((versions == versions[0]).all())


def _follows(keys: np.ndarray, last: int | None) -> bool:
    """Whether ``keys`` are strictly ascending and all after ``last``."""
    if not len(keys):
        return True
    return ascending(keys) and (last is None or int(keys[0]) > last)
