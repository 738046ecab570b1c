"""Alibaba PAI FeatureStore through its Python SDK ``feature_store_py`` (optional, not on PyPI).

Install the SDK wheel from Alibaba Cloud (see docs/stores.md) and ``deltarec[featurestore]``.
The backend was written against the SDK's documented surface and is tested against a fake
module at that boundary (``tests/stores/test_featurestore.py``); it has not run against a live
FeatureStore from this repository.

Layout: one **DynamicEmbedding** feature view ``<view>`` in project ``<project>`` holds every
table: primary key ``embedding_name`` = the table id, secondary key ``key_id`` = the row key,
``embedding`` = the row's values as float32 (float16 and int8_rowwise rows are decoded first;
reads re-encode them). The view and its feature entity are provisioned if missing.

Writes: ``write_features_arrow`` (columnar) with ``write_mode="MERGE"``, falling back to the
row-wise ``write_features`` when the SDK lacks the Arrow call; every write carries a timestamp
that increases strictly within the process, and ``write_flush`` must report every record
written. FeatureStore cannot delete: an evicted ZCH id (``op = 1``) is written with the row
passed (the fallback row), as SPEC §5 asks. The SDK offers no version-guarded write, so the
version guard is the publisher's: parts are published in dump order and never re-published
once their progress mark is complete.

Registry: FeatureStore has no place for it, so generations, progress marks, serving pointer and
freshness live in a small **registry store** (``registry=`` URL option; default a SQLite file
``deltarec-registry-<project>-<view>.db`` in the working directory). Marks are written right
after the rows (``atomic_marks = False``: at-least-once, replays are MERGEs of the same rows).

Credentials: only the Alibaba Cloud default credential chain (``alibabacloud_credentials``) and
``FEATUREDB_USERNAME``/``FEATUREDB_PASSWORD``; never the URL.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import numpy as np
import pyarrow as pa

from deltarec.artifacts import codec
from deltarec.artifacts.types import TableSpec
from deltarec.errors import ConfigError, StoreError, StoreUnavailableError
from deltarec.stores.base import Registry, Store
from deltarec.stores.config import FeatureStoreConfig
from deltarec.stores.rows import checked_arrays
from deltarec.stores.types import (
    Capabilities,
    ProgressMark,
    ReadResult,
    ViewInfo,
)

PK_FIELD = "embedding_name"
SK_FIELD = "key_id"
VALUE_FIELD = "embedding"
WRITE_MODE = "MERGE"
_SDK_ROWS = 1000  # rows per SDK call (the SDK's own HTTP batch size)
_TRANSIENT = (ConnectionError, TimeoutError, OSError)


class FeatureStoreStore(Store):
    """The PAI FeatureStore backend (write, read back, registry in a side store).

    Args:
        config: the parsed ``featurestore://project/view?region=...`` URL.
        sdk: the ``feature_store_py`` module (default: imported); tests pass a fake.
        credentials: an object with ``get_credential()`` (default: the Alibaba Cloud chain).
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
        self, config: FeatureStoreConfig, sdk: Any = None, credentials: Any = None
    ) -> None:
        from deltarec.stores.registry import open_store

        self.config = config
        self._lock = threading.RLock()
        self._last_ts = 0
        registry = config.registry or (
            f"sqlite:///deltarec-registry-{config.project}-{config.view}.db?prefix=fsview_"
        )
        if registry.startswith("featurestore:"):
            raise ConfigError("the registry of a featurestore store cannot be a featurestore")
        self._side = open_store(registry)
        try:
            self._view = self._open_view(sdk, credentials)
        except BaseException:
            self._side.close()
            raise

    def describe(self) -> str:
        """``featurestore://project/view?region=...``."""
        c = self.config
        return f"featurestore://{c.project}/{c.view}?region={c.region}"

    # ---- SDK -----------------------------------------------------------------------------
    def _open_view(self, sdk: Any, credentials: Any) -> Any:
        sdk = sdk or _import("feature_store_py", "the FeatureStore SDK wheel from Alibaba Cloud")
        if credentials is None:
            creds = _import("alibabacloud_credentials.client", "alibabacloud-credentials")
            credentials = creds.Client()
        c = self.config
        with self._errors("connect"):
            cred = credentials.get_credential()
            client = sdk.FeatureStoreClient(
                access_key_id=cred.access_key_id,
                access_key_secret=cred.access_key_secret,
                security_token=getattr(cred, "security_token", None) or None,
                region=c.region,
                endpoint=c.endpoint,
                featuredb_username=os.environ.get("FEATUREDB_USERNAME") or None,
                featuredb_password=os.environ.get("FEATUREDB_PASSWORD") or None,
            )
            project = client.get_project(c.project)
        if project is None:
            raise ConfigError(f"{self.describe()}: FeatureStore project {c.project!r} not found")
        self._project = project
        with self._errors("open view"):
            return project.get_dynamic_embedding_feature_view(c.view)

    def _errors(self, what: str) -> AbstractContextManager[None]:
        return _error_map(f"{self.describe()}: {what}")

    def _ensure_view(self) -> Any:
        if self._view is not None:
            return self._view
        c = self.config
        with self._errors("provision"):
            if self._project.get_entity(c.entity) is None:
                self._project.create_entity(c.entity, f"{c.entity}_id")
            self._project.create_dynamic_embedding_feature_view(
                name=c.view,
                entity=c.entity,
                pk_field_name=PK_FIELD,
                sk_field_name=SK_FIELD,
                embedding_field_name=VALUE_FIELD,
                pk_field_type="STRING",
                sk_field_type="INT64",
                ttl=c.ttl_s,
                shard_count=c.shard_count,
                replication_count=1,
            )
            self._view = self._project.get_dynamic_embedding_feature_view(c.view)
        if self._view is None:
            raise StoreError(f"{self.describe()}: the view did not appear after creation")
        fields = (self._view.pk_field, self._view.sk_field, self._view.embedding_field)
        if fields != (PK_FIELD, SK_FIELD, VALUE_FIELD):
            raise StoreError(
                f"{self.describe()}: view fields {fields} are not "
                f"{(PK_FIELD, SK_FIELD, VALUE_FIELD)}; it was not created by deltarec"
            )
        return self._view

    def _next_ts(self) -> int:
        with self._lock:
            self._last_ts = max(time.time_ns() // 1_000_000, self._last_ts + 1)
            return self._last_ts

    # ---- views ---------------------------------------------------------------------------
    def provision(
        self, tables: Mapping[str, TableSpec], staging_generation: int | None = None
    ) -> dict[str, ViewInfo]:
        """Create the DynamicEmbedding view and entity if missing; record dims and dtypes."""
        if staging_generation:
            raise self._unsupported("staging views (use publish mode 'direct')")
        self._ensure_view()
        recorded = self._side.provision(tables)
        return {t: ViewInfo(t, self.config.view, v.dim, v.dtype) for t, v in recorded.items()}

    def views(self, staging_generation: int | None = None) -> dict[str, ViewInfo]:
        """The tables provisioned (their dims and dtypes, from the registry store)."""
        if staging_generation:
            return {}
        return {
            t: ViewInfo(t, self.config.view, v.dim, v.dtype) for t, v in self._side.views().items()
        }

    def _spec(self, table: str) -> ViewInfo:
        views = self.views()
        if table not in views:
            from deltarec.errors import BadInputError

            raise BadInputError(
                f"table {table!r} is not provisioned in {self.describe()}; run `deltarec provision`"
            )
        return views[table]

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
        """MERGE the rows (op=1 rows written as given: the fallback row), then the mark."""
        if staging_generation:
            raise self._unsupported("staging views")
        view_info = self._spec(table)
        keys, ops, versions = checked_arrays(table, view_info, keys, embedding, ops, versions)
        if mark is not None:  # FeatureStore has no transactions: the fence goes first
            self.registry.check_writer(mark.run, mark.generation)
        values = codec.decode(embedding, view_info.dtype, view_info.dim).astype(np.float32)
        view = self._ensure_view()
        n = int(keys.shape[0])
        with self._errors(f"write {n} rows of {table!r}"):
            for start in range(0, n, _SDK_ROWS):
                stop = min(n, start + _SDK_ROWS)
                self._send(view, table, keys[start:stop], values[start:stop])
            if n:
                self._flush(view, n)
        if mark is not None:
            self.registry.record_progress(mark)
        return n

    def _send(self, view: Any, table: str, keys: np.ndarray, values: np.ndarray) -> None:
        ts = self._next_ts()
        version = self.config.sdk_version
        write_arrow = getattr(view, "write_features_arrow", None)
        if callable(write_arrow):  # older SDK wheels only have the row-wise call
            dim = values.shape[1]
            emb = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), dim)
            batch = pa.RecordBatch.from_arrays(
                [pa.array([table] * len(keys), pa.string()), pa.array(keys, pa.int64()), emb],
                names=[PK_FIELD, SK_FIELD, VALUE_FIELD],
            )
            write_arrow(batch=batch, version=version, write_mode=WRITE_MODE, ts=ts)
            return
        data = [
            {PK_FIELD: table, SK_FIELD: int(k), VALUE_FIELD: v}
            for k, v in zip(keys.tolist(), values, strict=True)
        ]
        view.write_features(data=data, version=version, write_mode=WRITE_MODE, ts=ts)

    def _flush(self, view: Any, expected: int) -> None:
        summary = view.write_flush()
        keys = ("total_records", "success_records", "failed_records")
        if not isinstance(summary, dict) or not all(k in summary for k in keys):
            raise StoreError(f"{self.describe()}: write_flush returned {summary!r}")
        if int(summary["failed_records"]) or int(summary["success_records"]) != expected:
            raise StoreUnavailableError(
                f"{self.describe()}: {summary['failed_records']} of {summary['total_records']} "
                f"records failed (expected {expected} written): {summary.get('errors')}"
            )

    def read(
        self, table: str, keys: np.ndarray, staging_generation: int | None = None
    ) -> ReadResult:
        """Read rows back with ``get_online_features`` (versions are not stored: 0)."""
        if staging_generation:
            raise self._unsupported("staging views")
        info = self._spec(table)
        keys = np.asarray(keys, dtype=np.int64)
        n = int(keys.shape[0])
        width = codec.encoded_width(info.dtype, info.dim)
        out = ReadResult(
            np.zeros(n, bool),
            np.zeros(n, np.int64),
            np.zeros((n, width), codec.element_type(info.dtype)),
        )
        position = {int(k): i for i, k in enumerate(keys.tolist())}
        view = self._ensure_view()
        for start in range(0, n, _SDK_ROWS):
            chunk = keys[start : start + _SDK_ROWS].tolist()
            with self._errors(f"read {len(chunk)} rows of {table!r}"):
                rows = view.get_online_features(
                    feature_name=table, keys=chunk, version=self.config.sdk_version
                )
            for row in rows:
                i = position[int(row.get("sk", row.get(SK_FIELD)))]
                value = np.asarray(row[VALUE_FIELD], np.float32).reshape(1, -1)
                out.found[i] = True
                out.embedding[i] = codec.encode(value, info.dtype)[0]
        return out

    def scan_keys(self, table: str, batch_rows: int = 65536) -> Iterator[np.ndarray]:
        """Not available: the SDK cannot list a view's keys."""
        raise self._unsupported("listing keys (verify --all); verify a sample instead")

    # ---- registry ------------------------------------------------------------------------
    @property
    def registry(self) -> Registry:
        """The side store's registry (FeatureStore has no place for one)."""
        return self._side.registry

    def close(self) -> None:
        """Close the SDK writer and the registry store (idempotent)."""
        try:
            if self._view is not None and hasattr(self._view, "close"):
                with self._errors("close"):
                    self._view.close(wait=True)
            self._view = None
        finally:
            self._side.close()


@contextmanager
def _error_map(where: str) -> Iterator[None]:
    """Map SDK exceptions: network ones to StoreUnavailableError, the rest to StoreError."""
    try:
        yield
    except (StoreError, ConfigError):
        raise
    except _TRANSIENT as e:
        raise StoreUnavailableError(f"{where}: {type(e).__name__}: {e}") from e
    except Exception as e:
        raise StoreError(f"{where}: {type(e).__name__}: {e}") from e


def _import(module: str, what: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(
            f"the featurestore store needs {module!r} ({what}); it is not installed"
        ) from e


__all__ = ["FeatureStoreStore"]
