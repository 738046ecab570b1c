"""Alibaba PAI FeatureStore through its Python SDK ``feature_store_py`` (optional, not on PyPI).

Install the SDK wheel from Alibaba Cloud and ``deltarec[featurestore]`` (docs/featurestore.md).
The backend is tested against a strict test double of the SDK (``tests/stores/sdk``) modelled
on how TorchEasyRec's uploader and readback tool call the real one; it has not run against a
live FeatureStore from this repository.

Layout: one **DynamicEmbedding** feature view ``<view>`` of project ``<project>`` holds every
table: primary key ``embedding_name`` (the table id; with ``contract=tzrec`` TorchEasyRec's
name, see :func:`~deltarec.stores.featurestore_sdk.tzrec_embedding_name`), sub key ``key_id``
(the row key), ``embedding`` the row's values: ``ARRAY<FLOAT>`` of the decoded row, or with
``contract=tzrec`` for ``int8_rowwise`` tables ``ARRAY<UINT8>`` of the ``dim + 4`` encoded bytes
(uint8 codes, fp16 scale, fp16 offset: QUint8RowwiseF16). Rank 0 creates the entity and the
view if missing; other ranks wait for it; an existing view's field names and types are checked
when it is opened.

Writes: ``write_features`` with ``write_mode="MERGE"`` in batches of ``batch_size`` rows (at
most the view's ``_batch_size``), ``_max_workers`` batches in flight, then ``write_flush``,
whose every summary field is checked; after a failed attempt the writer is drained and the
client rebuilt before the retry. Every batch carries a timestamp that increases strictly
within the process. FeatureStore cannot delete: an ``op = 1`` row of a ZCH table (an evicted
id, or with the dumper's ``zch_misses`` an id looked up but never admitted) is written with the
row passed (its fallback row), as SPEC §5 asks and as TorchEasyRec publishes such ids
(:func:`wants_zch_misses`), and it keeps no versions: the version guard
is the publisher's (parts are published in dump order and never again once their progress mark
is complete), and verify compares rows by value.

Registry: FeatureStore has no place for it, so generations, progress marks, serving pointer and
freshness live in a side store (:attr:`registry`): ``registry=<store URL>``, by default a
SQLite file under the artifact root (``<root>/_registry/featurestore-<project>-<view>.db``),
which every step of a pipeline sees. Marks are written right after the rows
(``atomic_marks = False``: at-least-once; a replay MERGEs the same rows again).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from deltarec.artifacts import codec
from deltarec.artifacts.types import FALLBACK_KEY, TableSpec
from deltarec.errors import BadInputError, ConfigError, StoreError
from deltarec.stores.base import Registry, Store
from deltarec.stores.config import FeatureStoreConfig
from deltarec.stores.featurestore_sdk import (
    SK_FIELD,
    VALUE_FIELD,
    WRITE_MODE,
    Layout,
    Session,
    check_summary,
    sdk_error,
    view_field_type,
)
from deltarec.stores.rows import checked_arrays
from deltarec.stores.types import Capabilities, ProgressMark, ReadResult, ViewInfo

REGISTRY_DIR = "_registry"
"""Directory under the artifact root holding the default registry of FeatureStore stores."""


class FeatureStoreStore(Store):
    """The PAI FeatureStore backend (rows in FeatureStore, registry in a side store).

    Args:
        config: the parsed ``featurestore://project/view?region=...`` URL.
        artifacts: the artifact root, where the default registry lives (a local path).
        sdk: the ``feature_store_py`` module (default: imported).
        credentials: an object with ``get_credential()`` (default: the Alibaba Cloud chain).
        rank: this process's rank (default: ``$RANK``, else 0); rank 0 creates the view.
    """

    kind = "featurestore"
    capabilities = Capabilities(
        deletes=False,
        atomic_marks=False,
        atomic_merge=False,
        staging=False,
        scan=False,
        snapshot_replace=False,
        versions=False,
    )

    def __init__(
        self,
        config: FeatureStoreConfig,
        artifacts: str | None = None,
        sdk: Any = None,
        credentials: Any = None,
        rank: int | None = None,
    ) -> None:
        from deltarec.stores.registry import open_store

        self.config = config
        if config.contract == "tzrec":  # TorchEasyRec reserves key -1 as the invalid key
            self.capabilities = replace(type(self).capabilities, fallback_key=False)
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else int(rank)
        self._lock = threading.RLock()
        self._last_ts = 0
        self._session = Session(config, self.describe(), sdk, credentials)
        url = config.registry or default_registry(config, artifacts)
        if url.startswith("featurestore:"):
            raise ConfigError("the registry of a featurestore store cannot be a featurestore")
        self._side = open_store(url)

    def describe(self) -> str:
        """``featurestore://project/view?region=...`` (with the contract when not the default)."""
        c = self.config
        out = f"featurestore://{c.project}/{c.view}?region={c.region}"
        return out + ("&contract=tzrec" if c.contract == "tzrec" else "")

    # ---- registry ------------------------------------------------------------------------
    @property
    def registry(self) -> Registry:
        """The side store's registry (FeatureStore has no place for one)."""
        return self._side.registry

    # ---- views ---------------------------------------------------------------------------
    def provision(
        self, tables: Mapping[str, TableSpec], staging_generation: int | None = None
    ) -> dict[str, ViewInfo]:
        """Create (rank 0) or open the view, check it, and record the tables' dims and dtypes.

        Raises:
            ViewMismatchError: the view's fields, or a table's recorded dim or dtype, differ.
            ConfigError: the tables need two embedding field types in one view.
        """
        if staging_generation:
            raise self._unsupported("staging views (use publish mode 'direct')")
        layouts = {t: self._layout(t, s) for t, s in tables.items()}
        names: dict[str, str] = {}
        for lay in layouts.values():
            if names.setdefault(lay.name, lay.table) != lay.table:
                raise BadInputError(
                    f"{self.describe()}: tables {names[lay.name]!r} and {lay.table!r} have "
                    f"one embedding_name {lay.name!r}"
                )
        known = {
            t: Layout.of(t, TableSpec(v.dim, v.dtype), self.config.contract)
            for t, v in self._side.views().items()
        }
        field_type = view_field_type({**known, **layouts}, self.describe())
        self._open(field_type)
        recorded = self._side.provision(tables)
        return {t: ViewInfo(t, self.config.view, v.dim, v.dtype) for t, v in recorded.items()}

    def views(self, staging_generation: int | None = None) -> dict[str, ViewInfo]:
        """The tables provisioned (their dims and dtypes, from the registry store)."""
        if staging_generation:
            return {}
        return {
            t: ViewInfo(t, self.config.view, v.dim, v.dtype) for t, v in self._side.views().items()
        }

    def _layout(self, table: str, spec: TableSpec) -> Layout:
        return Layout.of(table, spec, self.config.contract)

    def _table(self, table: str) -> Layout:
        views = self._side.views()
        if table not in views:
            raise BadInputError(
                f"table {table!r} is not provisioned in {self.describe()}; run `deltarec provision`"
            )
        v = views[table]
        return self._layout(table, TableSpec(v.dim, v.dtype))

    def _open(self, field_type: str | None) -> Any:
        return self._session.open_view(field_type, self.rank)

    def _next_ts(self) -> int:
        with self._lock:
            self._last_ts = max(time.time_ns() // 1_000_000, self._last_ts + 1)
            return self._last_ts

    # ---- rows ----------------------------------------------------------------------------
    def write(
        self,
        table: str,
        keys: np.ndarray,
        embedding: np.ndarray,
        ops: np.ndarray,
        versions: np.ndarray,
        mark: ProgressMark | None = None,
        staging_generation: int | None = None,
    ) -> int:
        """MERGE the rows (``op = 1`` rows written as given: the fallback row), then the mark.

        Raises:
            StoreUnavailableError: a transient failure (the writer was drained and the client is
                rebuilt on the next call, with fresh credentials).
            StoreError: a failure retrying cannot fix (names the view, the table, the fix).
        """
        if staging_generation:
            raise self._unsupported("staging views")
        lay = self._table(table)
        info = ViewInfo(table, self.config.view, lay.spec.dim, lay.spec.dtype)
        keys, ops, versions = checked_arrays(table, info, keys, embedding, ops, versions)
        if mark is not None:  # FeatureStore has no transactions: the fence goes first
            self.registry.check_writer(mark.run, mark.generation)
        n = int(keys.shape[0])
        if not self.capabilities.fallback_key:
            keep = keys != FALLBACK_KEY
            keys, embedding = keys[keep], np.asarray(embedding)[keep]
        if len(keys):
            with self._lock:
                self._send(lay, keys, embedding)
        if mark is not None:
            self.registry.record_progress(mark)
        return n

    def _send(self, lay: Layout, keys: np.ndarray, embedding: np.ndarray) -> None:
        view = self._open(lay.field_type)
        where = self._session.where(f"write {len(keys)} rows", lay.table)
        try:
            batch = min(self.config.batch_size, int(getattr(view, "_batch_size", 1000)))
            window = max(1, int(getattr(view, "_max_workers", 1)))
            starts = list(range(0, len(keys), batch))
            for w in range(0, len(starts), window):
                sent = 0
                for s in starts[w : w + window]:
                    k, e = keys[s : s + batch], embedding[s : s + batch]
                    data = [
                        {"embedding_name": lay.name, SK_FIELD: key, VALUE_FIELD: value}
                        for key, value in zip(k.tolist(), lay.values(e), strict=True)
                    ]
                    view.write_features(
                        data=data,
                        version=self.config.sdk_version,
                        write_mode=WRITE_MODE,
                        ts=self._next_ts(),
                    )
                    sent += len(data)
                batches = len(starts[w : w + window])
                check_summary(view.write_flush(), sent, batches, where)
        except Exception as e:
            # A write_features() call may have queued part of its work before failing: drain
            # it and start the next attempt on a new client, so a retry never mixes with it.
            self._session.reset()
            raise sdk_error(e, where) from e

    def read(
        self, table: str, keys: np.ndarray, staging_generation: int | None = None
    ) -> ReadResult:
        """Read rows back with ``get_online_features`` (no versions are stored: 0)."""
        if staging_generation:
            raise self._unsupported("staging views")
        lay = self._table(table)
        keys = np.asarray(keys, dtype=np.int64)
        n = int(keys.shape[0])
        width = codec.encoded_width(lay.spec.dtype, lay.spec.dim)
        out = ReadResult(
            np.zeros(n, bool),
            np.zeros(n, np.int64),
            np.zeros((n, width), codec.element_type(lay.spec.dtype)),
        )
        if not n:
            return out
        position = {int(k): i for i, k in enumerate(keys.tolist())}
        view = self._open(None)
        step = int(getattr(view, "_batch_size", 1000))
        where = self._session.where(f"read rows of {lay.name!r}", table)
        for start in range(0, n, step):
            chunk = keys[start : start + step].tolist()
            try:
                rows = view.get_online_features(
                    feature_name=lay.name, keys=chunk, version=self.config.sdk_version
                )
            except Exception as e:
                self._session.reset()
                raise sdk_error(e, where) from e
            seen: set[int] = set()
            for row in rows:
                raw = row.get("sk", row.get(SK_FIELD))
                key = int(raw.decode() if isinstance(raw, bytes) else raw)
                if key in seen or key not in position:
                    raise StoreError(f"{where}: key {key} came back twice or was not asked for")
                seen.add(key)
                i = position[key]
                out.found[i] = True
                out.embedding[i] = lay.encoded(row[VALUE_FIELD], key, where)
        return out

    def scan_keys(self, table: str, batch_rows: int = 65536) -> Iterator[np.ndarray]:
        """Not available: the SDK cannot list a view's keys (``capabilities.scan`` is False)."""
        raise self._unsupported("listing keys; verify reads back every expected key instead")

    def close(self) -> None:
        """Drain the SDK writer (bounded by ``shutdown_timeout_s``) and close the registry."""
        try:
            view = self._session.view
            if view is not None:
                self._drain(view)
        finally:
            self._session.view = None
            self._side.close()

    def _drain(self, view: Any) -> None:
        errors: list[BaseException] = []

        def close() -> None:
            try:
                view.close(wait=True)
            except BaseException as e:  # handed to the closing thread
                errors.append(e)

        thread = threading.Thread(target=close, name="featurestore-drain", daemon=True)
        thread.start()
        thread.join(self.config.shutdown_timeout_s)
        if thread.is_alive():
            raise StoreError(
                self._session.where(
                    f"the SDK writer did not drain within {self.config.shutdown_timeout_s:g}s"
                    "; rows not flushed are republished from the artifacts by `deltarec publish`"
                )
            )
        if errors:
            raise sdk_error(errors[0], self._session.where("close"))


def wants_zch_misses(url: str) -> bool:
    """Whether the store at ``url`` needs the ZCH ids the model answers with its fallback row.

    True for a ``featurestore://`` URL with ``contract=tzrec``: TorchEasyRec publishes every
    ZCH id training looked up, held or not, and its serving finds no row for an id it did not
    publish; the dumper's ``zch_misses`` setting writes those ids (``op = 1``, fallback row).

    Raises:
        ConfigError: ``url`` is a ``featurestore://`` URL that does not parse.
    """
    from deltarec.stores.config import parse_store_url

    if not url.lower().startswith("featurestore:"):
        return False
    config = parse_store_url(url)
    return isinstance(config, FeatureStoreConfig) and config.contract == "tzrec"


def default_registry(config: FeatureStoreConfig, artifacts: str | None) -> str:
    """The default registry URL: a SQLite file under a local artifact root.

    Raises:
        ConfigError: no artifact root is known, or it is not a local path (then name a
            registry store with ``registry=<store URL>``, e.g. a PostgreSQL URL).
    """
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
    directory = os.path.join(os.path.abspath(path), REGISTRY_DIR)
    os.makedirs(directory, exist_ok=True)
    name = f"featurestore-{config.project}-{config.view}.db"
    return f"sqlite:///{os.path.join(directory, name)}?prefix=fsview_"


__all__ = ["REGISTRY_DIR", "FeatureStoreStore", "default_registry", "wants_zch_misses"]
