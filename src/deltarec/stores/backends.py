"""Short backend names -> store classes, and :func:`open_store`.

Backends are imported only when opened, so a SQLite user never needs psycopg or redis-py, and
the store layer never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from deltarec.errors import ConfigError
from deltarec.ids import validate_run
from deltarec.stores.base import Store
from deltarec.stores.config import parse_config, parse_store_url

STORE_CLASSES: dict[str, str] = {
    "sqlite": "deltarec.stores.sql.sqlite.SqliteStore",
    "postgres": "deltarec.stores.sql.postgres.PostgresStore",
    "redis": "deltarec.stores.redis.store.RedisStore",
    "featurestore": "deltarec.stores.featurestore.store.FeatureStoreStore",
    "replica": "deltarec.stores.replica.store.ReplicaStore",  # read-only: a serving replica
}
"""Backend short name (the config's ``type``) -> ``module.Class``."""


def store_class(kind: str) -> type[Store]:
    """The class of backend ``kind``; raises :class:`ConfigError` if unknown or not installed."""
    try:
        path = STORE_CLASSES[kind]
    except KeyError:
        raise ConfigError(f"unknown store type {kind!r}; known: {sorted(STORE_CLASSES)}") from None
    module_name, _, cls_name = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            f"the {kind} store needs an optional dependency that is not installed "
            f"({e.name or e}); install deltarec[{kind}]"
        ) from e
    cls: type[Store] = getattr(module, cls_name)
    return cls


def open_store(
    url_or_config: str | dict[str, Any] | Any,
    artifacts: str | None = None,
    run: str | None = None,
) -> Store:
    """Open a store from its URL (``sqlite:///store.db``), a config mapping or a config model.

    ``artifacts`` is the artifact root the store is used with: a PAI FeatureStore store keeps
    its registry under it unless its URL names one (``registry=``); other stores ignore it.
    ``run`` is the run whose views the handle reads and writes (:attr:`Store.run`); without
    one the handle reads what serving reads and cannot write (docs/runs.md).

    Raises:
        ConfigError: bad URL or config, unknown backend, missing optional dependency.
        StoreUnavailableError: the store cannot be reached.
    """
    if isinstance(url_or_config, str):
        config = parse_store_url(url_or_config)
    elif isinstance(url_or_config, dict):
        config = parse_config(url_or_config)
    else:
        config = url_or_config
    if run is not None:
        validate_run(run)
    cls = store_class(config.type)
    kwargs = {"artifacts": artifacts} if config.type == "featurestore" else {}
    store = cls(config, **kwargs)  # type: ignore[call-arg]
    store.run = run
    return store
