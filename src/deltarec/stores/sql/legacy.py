"""SQL stores written before rows were kept per run: moved over, or refused.

Until rows were kept per run (docs/runs.md), a table's rows lived in one table at its serving
name (``emb_sparse_ebc_user_id``) whatever run wrote them, and ``deltarec_views`` had no
``run`` column. Opening such a store moves it to the per-run layout in one transaction, when
whose rows it holds is known:

* one run has published to it (the registry's generations and progress marks name one run):
  each table becomes that run's own view (renamed to ``emb_<run>__<table>``, tombstones with
  it), and its old name becomes the serving name, a SQL view of the same rows, so serving
  reads exactly what it read before;
* no run has: empty tables are dropped (there is nothing to keep) and the registry is rebuilt.

A Redis store moves the same way (:func:`deltarec.stores.redis.legacy.migrate_runless`).

Otherwise (several runs, or rows no run can be named for) the store is left exactly as it is
and every row operation is refused with :func:`migrate_legacy_views`'s message, which says
what to do: nothing already published is lost, and nothing is guessed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deltarec.stores.naming import quote, run_view_name, staging_prefix
from deltarec.stores.runviews import runless_problem
from deltarec.stores.sql.ddl import SERVING_VIEWS_DDL, VIEWS_DDL

if TYPE_CHECKING:
    from deltarec.stores.types import ViewInfo

_LEGACY_COLUMNS = (
    "name, table_id, staging_generation, dim, dtype, layout, floor_version, has_tombstones, "
    "created_at"
)


@dataclass(frozen=True)
class LegacyDialect:
    """What the move needs of the store being opened: its names and its dialect's SQL.

    Attributes:
        prefix: the store's view prefix.
        where: the store, for messages (its ``describe()``).
        columns: the column names of a registry table (empty if there is none).
        rows: run one query (``cur, sql[, params]``) and fetch its rows.
        exec: run one statement (``cur, sql[, params]``).
        drop_view_sql: the DDL dropping one view.
        point_serving: make a table's serving name read a view (in a transaction).
    """

    prefix: str
    where: str
    columns: Callable[[Any, str], set[str]]
    rows: Callable[..., list[tuple[Any, ...]]]
    exec: Callable[..., Any]
    drop_view_sql: Callable[[str], str]
    point_serving: Callable[[Any, str, str, ViewInfo], None]


def migrate_legacy_views(store: LegacyDialect, cur: Any) -> str | None:
    """Move a store of the runless layout to per-run views, inside the caller's transaction.

    Args:
        store: the store being opened: its names and its dialect's SQL.
        cur: a write transaction of ``store`` (the caller serializes openers: SQLite's
            ``BEGIN IMMEDIATE``, PostgreSQL's DDL lock).

    Returns:
        None when the store has the per-run layout (now or already), else why it is refused:
        the message every row operation raises, naming the runs and what to do.
    """
    columns = store.columns(cur, "deltarec_views")
    if not columns or "run" in columns:
        return None
    views = store.rows(cur, f"SELECT {_LEGACY_COLUMNS} FROM deltarec_views")
    runs = sorted(
        {str(r) for (r,) in store.rows(cur, "SELECT DISTINCT run FROM deltarec_generations")}
        | {str(r) for (r,) in store.rows(cur, "SELECT DISTINCT run FROM deltarec_progress")}
    )
    if len(runs) > 1 or (not runs and any(_holds_rows(store, cur, v[0]) for v in views)):
        return runless_problem(store.where, runs)
    store.exec(cur, "ALTER TABLE deltarec_views RENAME TO deltarec_views_runless")
    store.exec(cur, VIEWS_DDL)
    owner = runs[0] if runs else None
    store.exec(cur, SERVING_VIEWS_DDL)
    for view in views:
        _move_view(store, cur, owner, view)
    store.exec(cur, "DROP TABLE deltarec_views_runless")
    return None


def _holds_rows(store: LegacyDialect, cur: Any, name: str) -> bool:
    return bool(store.rows(cur, f"SELECT 1 FROM {quote(name)} LIMIT 1"))


def _move_view(store: LegacyDialect, cur: Any, owner: str | None, view: tuple[Any, ...]) -> None:
    """Make one runless view ``owner``'s own, its old name the serving name (live views)."""
    from deltarec.stores.types import ViewInfo

    name, table, stage, dim, dtype, layout, floor, tombstones, created = view
    if owner is None:  # never published and empty: nothing to keep
        store.exec(cur, store.drop_view_sql(name))
        store.exec(cur, "DELETE FROM deltarec_tombstones WHERE name = ?", (name,))
        return
    stage = int(stage)
    prefix = staging_prefix(store.prefix, stage) if stage else store.prefix
    new = run_view_name(owner, table, prefix)
    store.exec(cur, f"ALTER TABLE {quote(name)} RENAME TO {quote(new)}")
    store.exec(cur, "UPDATE deltarec_tombstones SET name = ? WHERE name = ?", (new, name))
    store.exec(
        cur,
        "INSERT INTO deltarec_views (name, run, table_id, staging_generation, dim, dtype, "
        "layout, floor_version, has_tombstones, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (new, owner, table, stage, dim, dtype, layout, floor, tombstones, created),
    )
    if not stage:
        store.point_serving(cur, table, name, ViewInfo(table, new, int(dim), dtype, run=owner))
