"""SQLite's bulk upsert: a statement's rows bound as one JSON key array and one blob.

A write's rows go in statements of up to :data:`STATEMENT_ROWS` rows, each ``INSERT ... SELECT
... FROM json_each(?)``: the keys are one JSON array and the rows one blob that SQL slices
(``substr``), so no Python object is made per row. Used by :mod:`deltarec.stores.sql.sqlite`.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from deltarec.stores.naming import quote

STATEMENT_BYTES = 4 << 20
"""At most this many bytes of rows per statement (wide rows: fewer rows)."""
STATEMENT_ROWS = 8192
"""Rows per ``INSERT ... SELECT ... FROM json_each(?)`` statement. A statement takes its keys
as one JSON array and its rows as one blob that SQL slices (``substr``), so no Python object
is made per row: about a third of the CPU of an ``executemany`` with one tuple per row."""


def json_rows(with_op: bool, per_row_versions: bool = False) -> str:
    """The rows of one statement, from its parameters.

    ``?1`` keys (a JSON array), ``?2`` rows (one blob), ``?3`` row width, ``?4`` version,
    ``?5`` updated_at (and ``?6`` op). With ``per_row_versions`` ``?4`` is every row's version
    as fixed-width decimal digits (:func:`_version_text`), so rows of several versions go in one
    key-ordered statement (a backlog of dumps written together).
    """
    op = ", ?6" if with_op else ""
    version = version_sql(per_row_versions)
    row = f"j.value, substr(?2, j.key * ?3 + 1, ?3), {version}, ?5{op}"
    return f"SELECT {row} FROM json_each(?1) AS j"


VERSION_DIGITS = 19
"""Decimal digits of a version in :func:`_version_text` (a non-negative int64 has at most 19)."""
_POWERS = 10 ** np.arange(VERSION_DIGITS - 1, -1, -1, dtype=np.int64)


def version_sql(per_row: bool) -> str:
    """The SQL of a row's version in :func:`json_rows`'s statement."""
    if not per_row:
        return "?4"
    return f"CAST(substr(?4, j.key * {VERSION_DIGITS} + 1, {VERSION_DIGITS}) AS INTEGER)"


def _version_text(versions: np.ndarray) -> bytes:
    """Non-negative int64 ``versions`` as zero-padded decimal digits, ``VERSION_DIGITS`` each.

    A blob, not text: ``substr`` of a blob counts bytes from its start at once, of text it
    walks the characters (every row's lookup would cost the statement's length).
    """
    digits = (versions[:, None] // _POWERS) % 10 + ord("0")
    return digits.astype(np.uint8).tobytes()


def upsert_sql(
    name: str,
    source: str,
    key: str,
    version: str,
    guard_tombstones: bool,
    where: str = "",
    tail: str = "",
    with_op: bool = False,
) -> str:
    """The versioned upsert into view ``name`` of the rows ``source`` selects.

    ``source`` selects ``key, embedding, version, updated_at`` (and ``op`` for a staging view),
    ``key`` and ``version`` name its key and version for the tombstone guard: with
    ``guard_tombstones`` a row is skipped if the key has a tombstone at a newer version (only
    views that ever saw a delete pay for that lookup). ``tail`` is an ``ORDER BY``.
    """
    q = quote(name)
    conditions = [where] if where else []
    if guard_tombstones:
        conditions.append(
            f"NOT EXISTS (SELECT 1 FROM deltarec_tombstones t WHERE t.name = '{name}' "
            f"AND t.key = {key} AND t.version > {version})"
        )
    columns = "key, embedding, version, updated_at" + (", op" if with_op else "")
    op = ", op = excluded.op" if with_op else ""
    return (
        f"INSERT INTO {q} ({columns}) {source} WHERE {' AND '.join(conditions) or 'true'}{tail} "
        "ON CONFLICT (key) DO UPDATE SET embedding = excluded.embedding, "
        f"version = excluded.version, updated_at = excluded.updated_at{op} "
        f"WHERE excluded.version >= {q}.version"
    )


def _statements(
    keys: np.ndarray,
    versions: np.ndarray,
    ops: np.ndarray | None,
    in_key_order: bool,
    select: np.ndarray | None,
    per_statement: int,
) -> Iterator[np.ndarray]:
    """Row indices per statement.

    The rows ``select`` picks (all if None) in runs sharing one op (staging views), each run in
    key order when ``in_key_order``, cut into statements of at most ``per_statement`` rows.
    Rows of several versions share a statement (each row carries its own, :func:`json_rows`)
    unless a version is negative (then runs share one version too).
    """
    idx = np.arange(len(keys)) if select is None else select
    if in_key_order:
        idx = idx[np.argsort(keys[idx], kind="stable")]
    pairs = np.zeros(len(idx), np.int64) if ops is None else ops[idx].astype(np.int64)
    if len(idx) and bool((versions[idx] < 0).any()):
        pairs = np.stack([versions[idx], pairs], axis=1)
    else:
        pairs = pairs[:, None]
    if len(idx) and not (pairs == pairs[0]).all():
        codes = np.unique(pairs, axis=0, return_inverse=True)[1].reshape(-1)
        grouped = np.argsort(codes, kind="stable")
        idx, codes = idx[grouped], codes[grouped]
        runs = np.split(idx, np.flatnonzero(codes[1:] != codes[:-1]) + 1)
    else:
        runs = [idx]
    for run in runs:
        for start in range(0, len(run), per_statement):
            yield run[start : start + per_statement]


def _ascending_by_one(idx: np.ndarray) -> bool:
    """Whether ``idx`` is ``idx[0], idx[0] + 1, ...`` (consecutive row indices)."""
    return bool((np.diff(idx) == 1).all())


def insert_rows(
    cur: sqlite3.Cursor,
    sql_of: Callable[[bool], str],
    keys: np.ndarray,
    embedding: np.ndarray,
    versions: np.ndarray,
    ops: np.ndarray | None,
    now: float,
    in_key_order: bool,
    select: np.ndarray | None = None,
) -> None:
    """Run ``sql_of(per_row_versions)`` (its source :func:`json_rows`) over rows.

    Statement by statement; the rows are those ``select`` picks (all if None); only one
    statement's rows are ever copied. A statement whose rows share one version binds it once,
    else every row's.
    """
    width = embedding.shape[1] * embedding.itemsize if embedding.ndim == 2 else 0
    per_statement = max(1, min(STATEMENT_ROWS, STATEMENT_BYTES // max(1, width)))
    contiguous = embedding.ndim == 2 and embedding.flags.c_contiguous
    for idx in _statements(keys, versions, ops, in_key_order, select, per_statement):
        lo = int(idx[0]) if len(idx) else 0
        if contiguous and len(idx) and int(idx[-1]) - lo == len(idx) - 1 and _ascending_by_one(idx):
            # Consecutive rows: bound as a view of the array (SQLite copies it once).
            rows: Any = embedding[lo : lo + len(idx)].data.cast("B")
            key_list = keys[lo : lo + len(idx)].tolist()
        else:
            rows, key_list = embedding[idx].tobytes(), keys[idx].tolist()
        held = versions[idx]
        one = bool((held == held[0]).all()) if len(idx) else True
        version: int | bytes = int(held[0]) if one and len(idx) else _version_text(held)
        params: tuple[Any, ...] = (json.dumps(key_list), rows, width, version, now)
        if ops is not None:
            params += (int(ops[idx[0]]),)
        cur.execute(sql_of(not one), params)


__all__ = [
    "STATEMENT_BYTES",
    "STATEMENT_ROWS",
    "VERSION_DIGITS",
    "insert_rows",
    "json_rows",
    "upsert_sql",
    "version_sql",
]
