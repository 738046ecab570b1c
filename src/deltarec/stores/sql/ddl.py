"""The SQL stores' registry tables (SQLite, PostgreSQL): their DDL, named once.

The relational stores create them (:mod:`deltarec.stores.sql.relational`) and a store of the layout
before rows were kept per run is moved to them (:mod:`deltarec.stores.sql.legacy`).
"""

from __future__ import annotations

VIEWS_DDL = """CREATE TABLE IF NOT EXISTS deltarec_views (
        name TEXT PRIMARY KEY, run TEXT NOT NULL, table_id TEXT NOT NULL,
        staging_generation BIGINT NOT NULL, dim BIGINT NOT NULL, dtype TEXT NOT NULL,
        layout TEXT NOT NULL, floor_version BIGINT NOT NULL DEFAULT 0,
        has_tombstones BIGINT NOT NULL DEFAULT 0, created_at DOUBLE PRECISION NOT NULL,
        UNIQUE (run, table_id, staging_generation))"""
"""The views' registry; its ``run`` column is what the per-run layout added (see
:mod:`deltarec.stores.sql.legacy` for stores written before it)."""

SERVING_VIEWS_DDL = """CREATE TABLE IF NOT EXISTS deltarec_serving_views (
        table_id TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE, run TEXT NOT NULL,
        switched_at DOUBLE PRECISION NOT NULL)"""

REGISTRY_DDL = (
    VIEWS_DDL,
    SERVING_VIEWS_DDL,
    """CREATE TABLE IF NOT EXISTS deltarec_tombstones (
        name TEXT NOT NULL, key BIGINT NOT NULL, version BIGINT NOT NULL,
        PRIMARY KEY (name, key))""",
    """CREATE TABLE IF NOT EXISTS deltarec_generations (
        run TEXT NOT NULL, generation BIGINT NOT NULL, registered_at DOUBLE PRECISION NOT NULL,
        merged_at DOUBLE PRECISION, PRIMARY KEY (run, generation))""",
    """CREATE TABLE IF NOT EXISTS deltarec_generation_origins (
        run TEXT NOT NULL, generation BIGINT NOT NULL, created_at TEXT NOT NULL,
        PRIMARY KEY (run, generation))""",
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
    """CREATE TABLE IF NOT EXISTS deltarec_low_marks (
        name TEXT PRIMARY KEY, version BIGINT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS deltarec_store_id (
        one BIGINT PRIMARY KEY CHECK (one = 1), id TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS deltarec_prefix (
        one BIGINT PRIMARY KEY CHECK (one = 1), prefix TEXT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS deltarec_featurestore_view (
        one BIGINT PRIMARY KEY CHECK (one = 1), view TEXT NOT NULL)""",
)


__all__ = ["REGISTRY_DDL", "SERVING_VIEWS_DDL", "VIEWS_DDL"]
