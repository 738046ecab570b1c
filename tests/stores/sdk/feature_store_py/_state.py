"""The test FeatureStore's shared state: one SQLite file, named by ``FEATURE_STORE_PY_STATE``.

Every process that imports the test ``feature_store_py`` (tests, and the ``deltarec`` commands
a test starts) sees the same projects, entities, views and rows. The helpers here are what a
FeatureStore console user does by hand (create a project, break the network for a while); they
are not part of the SDK surface.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from typing import Any

ENV = "FEATURE_STORE_PY_STATE"

_DDL = (
    "CREATE TABLE IF NOT EXISTS projects (name TEXT PRIMARY KEY)",
    "CREATE TABLE IF NOT EXISTS entities (project TEXT, name TEXT, join_id TEXT, "
    "PRIMARY KEY (project, name))",
    "CREATE TABLE IF NOT EXISTS views (project TEXT, name TEXT, entity TEXT, pk TEXT, sk TEXT, "
    "emb TEXT, pk_type TEXT, sk_type TEXT, emb_type TEXT, ttl INTEGER, shard_count INTEGER, "
    "replication_count INTEGER, PRIMARY KEY (project, name))",
    "CREATE TABLE IF NOT EXISTS rows (project TEXT, view TEXT, version TEXT, pk TEXT, "
    "sk INTEGER, ts INTEGER, value TEXT, PRIMARY KEY (project, view, version, pk, sk))",
    "CREATE TABLE IF NOT EXISTS faults (op TEXT PRIMARY KEY, remaining INTEGER, error TEXT)",
    "CREATE TABLE IF NOT EXISTS calls (at REAL, op TEXT, detail TEXT)",
)


def connect(path: str | None = None) -> sqlite3.Connection:
    """Open the state file (``path`` or ``$FEATURE_STORE_PY_STATE``), creating its tables."""
    path = path or os.environ.get(ENV)
    if not path:
        raise RuntimeError(f"the test feature_store_py needs {ENV} (its state file)")
    conn = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=OFF")
    for ddl in _DDL:
        conn.execute(ddl)
    return conn


def create_project(path: str, name: str) -> None:
    """Create project ``name`` (the FeatureStore console does this)."""
    with connect(path) as conn:
        conn.execute("INSERT OR IGNORE INTO projects VALUES (?)", (name,))


def inject_fault(path: str, op: str, times: int, error: str = "") -> None:
    """Make the next ``times`` calls of ``op`` fail.

    ``op`` is ``write_flush`` (the summary reports the batches failed), or any SDK method name
    (it raises ``error``, e.g. ``"503 ServiceUnavailable"`` or ``"403 InvalidAccessKeyId"``;
    an error starting ``network`` raises ``ConnectionError``; ``"hang S"`` makes the call take
    S seconds). For
    ``create_dynamic_embedding_feature_view`` an error starting ``race`` creates the view as
    another job would, then answers the conflict.
    """
    with connect(path) as conn:
        conn.execute("INSERT OR REPLACE INTO faults VALUES (?, ?, ?)", (op, times, error))


def take_fault(conn: sqlite3.Connection, op: str) -> str | None:
    """The error of one pending fault of ``op`` (consumed), or None."""
    row = conn.execute("SELECT remaining, error FROM faults WHERE op = ?", (op,)).fetchone()
    if row is None or row[0] <= 0:
        return None
    conn.execute("UPDATE faults SET remaining = remaining - 1 WHERE op = ?", (op,))
    return str(row[1])


def log_call(conn: sqlite3.Connection, op: str, detail: dict[str, Any]) -> None:
    """Record one SDK call (tests read them back with :func:`calls`)."""
    conn.execute("INSERT INTO calls VALUES (?, ?, ?)", (time.time(), op, json.dumps(detail)))


def calls(path: str, op: str | None = None) -> list[dict[str, Any]]:
    """Recorded SDK calls, oldest first (``op`` only, if given)."""
    with connect(path) as conn:
        rows = conn.execute("SELECT op, detail FROM calls ORDER BY rowid").fetchall()
    return [dict(json.loads(d), op=o) for o, d in rows if op is None or o == op]


def stored_rows(path: str, project: str, view: str, version: str) -> dict[tuple[str, int], Any]:
    """Every row of a view: ``(embedding_name, key_id) -> value`` (a list)."""
    with connect(path) as conn:
        rows = conn.execute(
            "SELECT pk, sk, value FROM rows WHERE project = ? AND view = ? AND version = ?",
            (project, view, version),
        ).fetchall()
    return {(pk, int(sk)): json.loads(v) for pk, sk, v in rows}


def set_row(path: str, project: str, view: str, version: str, pk: str, sk: int, value: Any) -> None:
    """Overwrite one stored row behind the SDK's back (a tampered row)."""
    with connect(path) as conn:
        conn.execute(
            "UPDATE rows SET value = ? WHERE project = ? AND view = ? AND version = ? "
            "AND pk = ? AND sk = ?",
            (json.dumps(value), project, view, version, pk, sk),
        )
