"""The registry of a PAI FeatureStore store: where it lives and what FeatureStore adds to it.

FeatureStore has no place for deltarec's control plane, so a relational store (SQLite or
PostgreSQL, :class:`~deltarec.stores.sql.registry.SqlRegistry`) holds it, with two tables of
its own (plain SQL, ``?`` placeholders as everywhere in the relational stores):

* ``deltarec_featurestore_versions(run, version, assigned_at)``: the FeatureStore ``version``
  each run writes under (docs/runs.md);
* ``deltarec_featurestore_tables(run, table_id, embedding_name)``: the name each table of a run
  is published as (with ``contract=tzrec`` TorchEasyRec's, from the module type at provision).
"""

from __future__ import annotations

import os
import time
from typing import Any

from deltarec.errors import ConfigError, StaleGenerationError
from deltarec.stores.config import FeatureStoreConfig

REGISTRY_DIR = "_registry"
"""Directory under the artifact root holding the default registry of FeatureStore stores."""

SIDE_DDL = (
    "CREATE TABLE IF NOT EXISTS deltarec_featurestore_versions (run TEXT PRIMARY KEY, "
    "version TEXT NOT NULL UNIQUE, assigned_at DOUBLE PRECISION NOT NULL)",
    "CREATE TABLE IF NOT EXISTS deltarec_featurestore_tables (run TEXT NOT NULL, "
    "table_id TEXT NOT NULL, embedding_name TEXT NOT NULL, PRIMARY KEY (run, table_id))",
)


def registry_location(config: FeatureStoreConfig, artifacts: str | None) -> tuple[str, str | None]:
    """``(registry URL, its SQLite file where it is the default one under the artifact root)``.

    Nothing is created here: the default file is made when the registry is first used.

    Raises:
        ConfigError: the URL names a featurestore registry; or no registry is named and no
            artifact root is known, or it is not a local path (then name a registry store
            with ``registry=<store URL>``, e.g. a PostgreSQL URL).
    """
    if config.registry:
        if config.registry.startswith("featurestore:"):
            raise ConfigError("the registry of a featurestore store cannot be a featurestore")
        return config.registry, None
    if not artifacts:
        raise ConfigError(
            f"featurestore://{config.project}/{config.view}: no registry: add "
            "registry=<store URL> (e.g. postgresql://...) or open it with the artifact root"
        )
    path = artifacts[len("file://") :] if artifacts.startswith("file://") else artifacts
    if "://" in path:
        raise ConfigError(
            f"featurestore://{config.project}/{config.view}: the artifact root {artifacts!r} is "
            "not a local path, so it cannot hold the registry's SQLite file; add "
            "registry=<store URL> (e.g. postgresql://...) that every pipeline step reaches"
        )
    name = f"featurestore-{config.project}-{config.view}.db"
    file = os.path.join(os.path.abspath(path), REGISTRY_DIR, name)
    return f"sqlite:///{file}?prefix=fsview_", file


def default_registry(config: FeatureStoreConfig, artifacts: str | None) -> str:
    """The default registry URL: a SQLite file under a local artifact root (see above)."""
    return registry_location(config, artifacts)[0]


def assign_version(side: Any, run: str, first: str, assign: bool) -> str | None:
    """The FeatureStore ``version`` of ``run``; with ``assign`` one is given if it has none.

    ``first`` (the store URL's ``sdk_version``) goes to the first run registered in the
    store, which wrote its rows under it before versions were per run, or to ``run`` when no
    run is registered; every other run gets ``<first>@<run>``. One registry transaction.

    Raises:
        ConfigError: ``<first>@<run>`` is held by another run (names it).
    """
    with side.transaction(write=assign) as cur:
        owned = {
            str(r): str(v)
            for r, v in side.query(cur, "SELECT run, version FROM deltarec_featurestore_versions")
        }
        if run in owned or not assign:
            return owned.get(run)
        if first not in owned.values():
            oldest = side.query(
                cur,
                "SELECT run FROM deltarec_generations ORDER BY registered_at, generation LIMIT 1",
            )
            owner = str(oldest[0][0]) if oldest and str(oldest[0][0]) not in owned else run
            _insert(side, cur, owner, first)
            owned[owner] = first
        if run not in owned:
            mine = f"{first}@{run}"
            holder = [r for r, v in owned.items() if v == mine]
            if holder:
                raise ConfigError(
                    f"FeatureStore version {mine!r} of run {run!r} is held by run {holder[0]!r}"
                    " in the registry; use another sdk_version"
                )
            _insert(side, cur, run, mine)
            owned[run] = mine
        return owned[run]


def _insert(side: Any, cur: Any, run: str, version: str) -> None:
    side.execute(
        cur,
        "INSERT INTO deltarec_featurestore_versions (run, version, assigned_at) VALUES (?, ?, ?)",
        (run, version, time.time()),
    )


def recorded_names(side: Any, run: str) -> dict[str, str]:
    """Table id -> the ``embedding_name`` recorded for ``run``'s tables."""
    with side.transaction(write=False) as cur:
        rows = side.query(
            cur,
            "SELECT table_id, embedding_name FROM deltarec_featurestore_tables WHERE run = ?",
            (run,),
        )
    return {str(t): str(n) for t, n in rows}


def record_names(side: Any, run: str, names: dict[str, str], where: str) -> None:
    """Record each table's ``embedding_name`` for ``run`` (one transaction).

    Raises:
        ConfigError: a table is already recorded under another name (names both).
    """
    with side.transaction() as cur:
        for table, name in names.items():
            have = side.query(
                cur,
                "SELECT embedding_name FROM deltarec_featurestore_tables "
                "WHERE run = ? AND table_id = ?",
                (run, table),
            )
            if have and str(have[0][0]) != name:
                raise ConfigError(
                    f"{where}: table {table!r} of run {run!r} is published as "
                    f"{have[0][0]!r}, but its spec names it {name!r}"
                )
            if not have:
                side.execute(
                    cur,
                    "INSERT INTO deltarec_featurestore_tables (run, table_id, embedding_name) "
                    "VALUES (?, ?, ?)",
                    (run, table, name),
                )


def check_newest(side: Any, cur: Any, run: str, generation: int) -> None:
    """The fence, in transaction ``cur``: raise if a newer generation of ``run`` is registered.

    Raises:
        StaleGenerationError: names both generations.
    """
    (newest,) = side.query(
        cur, "SELECT MAX(generation) FROM deltarec_generations WHERE run = ?", (run,)
    )[0]
    if newest is not None and int(newest) > generation:
        raise StaleGenerationError(side.describe_registry(), run, generation, int(newest))


__all__ = [
    "REGISTRY_DIR",
    "SIDE_DDL",
    "assign_version",
    "check_newest",
    "default_registry",
    "record_names",
    "recorded_names",
    "registry_location",
]
