"""The SQL backends: SQLite and PostgreSQL, and what only they share.

Modules:
    relational: :class:`~deltarec.stores.sql.relational.RelationalStore`, both stores' shared
        half (views, tombstones, versioned writes and the registry in SQL).
    sqlite, postgres: the two backends (``sqlite:///``, ``postgresql://``).
    upsert: SQLite's bulk upsert statements (keys as one JSON array, rows as one blob).
    registry: the control plane in SQL tables (``SqlRegistry``; also FeatureStore's side store).
    ddl: the registry's and views' DDL.
    legacy: moving a store of the runless layout to per-run views.
    pgload, pgcopy: PostgreSQL's bulk load (binary COPY, staging merge).
    spill, writebehind: SQLite's spill of large writes and its write-behind checkpointing.

Opened through :func:`deltarec.stores.open_store`; nothing outside :mod:`deltarec.stores`
imports these modules.
"""
