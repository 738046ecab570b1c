"""Online stores behind one small interface (SPEC §5).

Open a store by URL with :func:`open_store`; every backend implements :class:`Store` (views
and rows: provision, versioned write, read, scan, the sweep below a snapshot, staging merge)
and has a :class:`Registry` (``store.registry``: generations, progress marks, serving pointer,
freshness, snapshot records), and declares its :class:`Capabilities`.

Exports:
    open_store, store_class, STORE_CLASSES: the table of backends by short name.
    parse_store_url, redact_url and the configs: URL syntax and pydantic configs.
    Store, Registry, Capabilities, ReadResult, ProgressMark, ServingPointer, FreshnessRecord,
    SnapshotRecord, ViewInfo.
    view_name, check_identifier: physical names of views.
    check_batch: the row checks every backend applies.
    require_sdk, wants_zch_misses: what a store URL asks of a trainer before it starts.
    who_serves, Serving: who serves a store (the run per table, and its serving pointer).
    ReplicaStatus, token_from_env: what a serving replica says of itself (``GET /v1/status``)
        and its bearer token, shared by the ``replica://`` backend and ``deltarec.serving``.

Backends live one folder each (``sql/``, ``redis/``, ``featurestore/``, ``replica/``) and are
imported only when opened (:mod:`deltarec.stores.backends`); nothing outside this package
imports them.
"""

from deltarec.stores.backends import STORE_CLASSES, open_store, store_class
from deltarec.stores.base import Registry, Store
from deltarec.stores.config import (
    FeatureStoreConfig,
    PostgresConfig,
    RedisConfig,
    SqliteConfig,
    StoreConfig,
    parse_config,
    parse_store_url,
    redact_url,
)
from deltarec.stores.naming import check_identifier, view_name
from deltarec.stores.replica.status import ReplicaStatus, token_from_env
from deltarec.stores.rows import check_batch
from deltarec.stores.types import (
    Capabilities,
    FreshnessRecord,
    ProgressMark,
    ReadResult,
    RowBatch,
    ServingPointer,
    SnapshotRecord,
    ViewInfo,
)
from deltarec.stores.urlneeds import require_sdk, wants_zch_misses
from deltarec.stores.whoserves import Serving, who_serves

__all__ = [
    "STORE_CLASSES",
    "Capabilities",
    "FeatureStoreConfig",
    "FreshnessRecord",
    "PostgresConfig",
    "ProgressMark",
    "ReadResult",
    "RedisConfig",
    "Registry",
    "ReplicaStatus",
    "RowBatch",
    "Serving",
    "ServingPointer",
    "SnapshotRecord",
    "SqliteConfig",
    "Store",
    "StoreConfig",
    "ViewInfo",
    "check_batch",
    "check_identifier",
    "open_store",
    "parse_config",
    "parse_store_url",
    "redact_url",
    "require_sdk",
    "store_class",
    "token_from_env",
    "view_name",
    "wants_zch_misses",
    "who_serves",
]
