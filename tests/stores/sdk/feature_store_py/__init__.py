"""A strict test double of PAI FeatureStore's Python SDK, ``feature_store_py``.

It offers exactly the calls merged TorchEasyRec makes (alibaba/TorchEasyRec master:
``tzrec/utils/feature_store_delta_uploader.py`` and the readback tool
``tzrec/tools/feature_store/check_feature_store_delta.py``): ``FeatureStoreClient(...)``,
``get_project``, ``get_entity``/``create_entity(name, join_id)``,
``get_dynamic_embedding_feature_view``, ``create_dynamic_embedding_feature_view``, and on the
view handle ``pk_field``/``sk_field``/``embedding_field``/``embedding_field_type``,
``_batch_size``/``_max_workers``, ``write_features``, ``write_features_arrow``,
``write_flush``, ``get_online_features`` and ``close``; the same keyword names, and nothing
else. An unknown keyword raises ``TypeError`` (no ``**kwargs`` anywhere).

``FEATURE_STORE_PY_SURFACE`` picks a variant of that surface:

* ``tzrec`` (the default): exactly the calls above;
* ``control-plane``: also ``project.get_feature_view(name)`` (control-plane metadata: field
  types, TTL, shards, replicas), which early versions of TorchEasyRec's uploader called;
* ``untyped``: an SDK older than 2.2.8: the view handle has no ``embedding_field_type`` and no
  ``write_features_arrow`` (a legacy float view, as TorchEasyRec reads it).

State (projects, entities, views, rows) lives in one SQLite file named by
``FEATURE_STORE_PY_STATE`` (private module ``_state``; tests reach it through
``tests._helpers.featurestore``), so every process of a test sees the same rows.
Semantics modelled: ``write_features`` enqueues one HTTP batch (at most the view's
``_batch_size`` rows); ``write_flush`` applies what is queued and returns the summary;
``MERGE`` keeps, per ``(version, embedding_name, key_id)``, the row of the newest ``ts``; rows
are typed by the view's embedding field (``ARRAY<FLOAT>`` or ``ARRAY<UINT8>``); reads return
only keys that hold a row, the key as a string.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from typing import Any

from feature_store_py import _state as fs_state

SURFACE_ENV = "FEATURE_STORE_PY_SURFACE"
_SURFACES = ("tzrec", "control-plane", "untyped")
_WRITE_MODES = ("MERGE",)
_TYPES = ("ARRAY<FLOAT>", "ARRAY<UINT8>")


class FeatureStoreError(Exception):
    """What the service answers with an error (the message carries the HTTP code)."""


def _fault(conn: Any, op: str) -> None:
    error = fs_state.take_fault(conn, op)
    if error is not None and error.startswith("hang"):  # a writer that never drains
        time.sleep(float(error.split()[1]))
        return
    if error is not None:
        if error.startswith("network"):
            raise ConnectionError(error)
        raise FeatureStoreError(error)


class FeatureStoreClient:
    """The SDK client: credentials, region, endpoint."""

    def __init__(
        self,
        access_key_id: str | None = None,
        access_key_secret: str | None = None,
        region: str | None = None,
        endpoint: str | None = None,
        security_token: str | None = None,
        featuredb_username: str | None = None,
        featuredb_password: str | None = None,
        test_mode: bool = False,
    ) -> None:
        if not access_key_id or not access_key_secret:
            raise FeatureStoreError("403 InvalidAccessKeyId: access key id and secret required")
        if not region:
            raise FeatureStoreError("400 MissingRegionId: region is required")
        if bool(featuredb_username) != bool(featuredb_password):
            raise FeatureStoreError("401 FeatureDB username and password go together")
        self._conn = fs_state.connect()
        fs_state.log_call(
            self._conn,
            "client",
            {
                "region": region,
                "endpoint": endpoint,
                "has_token": bool(security_token),
                "access_key_id": access_key_id,
                "featuredb_username": featuredb_username,
            },
        )
        _fault(self._conn, "FeatureStoreClient")

    def get_project(self, name: str) -> Project | None:
        """The project ``name``, or None."""
        _fault(self._conn, "get_project")
        row = self._conn.execute("SELECT 1 FROM projects WHERE name = ?", (name,)).fetchone()
        if not row:
            return None
        surface = os.environ.get(SURFACE_ENV, "tzrec")
        if surface not in _SURFACES:
            raise RuntimeError(f"{SURFACE_ENV}={surface!r}: one of {_SURFACES}")
        return (
            ControlPlaneProject(self._conn, name)
            if surface == "control-plane"
            else Project(self._conn, name)
        )


class FeatureView:
    """Control-plane metadata of a feature view (``project.get_feature_view``)."""

    def __init__(self, row: tuple[Any, ...]) -> None:
        _, name, entity, pk, sk, emb, pk_type, sk_type, emb_type, ttl, shards, replicas = row
        self.name = name
        self.type = "DynamicEmbedding"
        self.feature_entity_name = entity
        self.fields_dict = {
            pk: {"Type": pk_type, "Attributes": ["PrimaryKey"]},
            sk: {"Type": sk_type, "Attributes": ["SubKey"]},
            emb: {"Type": emb_type, "Attributes": []},
        }
        self.summary = {
            "Config": json.dumps({"ttl": ttl, "shard_count": shards, "replication_count": replicas})
        }


class Project:
    """A FeatureStore project."""

    def __init__(self, conn: Any, name: str) -> None:
        self._conn = conn
        self.name = name

    def get_entity(self, name: str) -> dict[str, str] | None:
        """The feature entity ``name`` (its join id), or None."""
        row = self._conn.execute(
            "SELECT join_id FROM entities WHERE project = ? AND name = ?", (self.name, name)
        ).fetchone()
        return {"name": name, "join_id": row[0]} if row else None

    def create_entity(self, name: str, join_id: str) -> None:
        """Create a feature entity; an existing one is an error."""
        _fault(self._conn, "create_entity")
        try:
            self._conn.execute("INSERT INTO entities VALUES (?, ?, ?)", (self.name, name, join_id))
        except Exception as e:
            raise FeatureStoreError(f"409 EntityAlreadyExists: {name}") from e

    def _view_row(self, name: str) -> tuple[Any, ...] | None:
        row: tuple[Any, ...] | None = self._conn.execute(
            "SELECT * FROM views WHERE project = ? AND name = ?", (self.name, name)
        ).fetchone()
        return row

    def get_dynamic_embedding_feature_view(
        self, name: str
    ) -> UntypedDynamicEmbeddingFeatureView | None:
        """The DynamicEmbedding view ``name`` (its reader and writer), or None."""
        _fault(self._conn, "get_dynamic_embedding_feature_view")
        row = self._view_row(name)
        if not row:
            return None
        if os.environ.get(SURFACE_ENV) == "untyped":
            return UntypedDynamicEmbeddingFeatureView(self._conn, self.name, row)
        return DynamicEmbeddingFeatureView(self._conn, self.name, row)

    def create_dynamic_embedding_feature_view(
        self,
        name: str,
        entity: str,
        pk_field_name: str,
        sk_field_name: str,
        embedding_field_name: str,
        pk_field_type: str = "STRING",
        sk_field_type: str = "INT64",
        embedding_field_type: str = "ARRAY<FLOAT>",
        ttl: int = 15 * 86400,
        shard_count: int = 20,
        replication_count: int = 1,
    ) -> DynamicEmbeddingFeatureView:
        """Create a DynamicEmbedding view; an existing one (same name) is an error."""
        race = fs_state.take_fault(self._conn, "create_dynamic_embedding_feature_view")
        if race is not None and not race.startswith("race"):
            raise FeatureStoreError(race)
        if self.get_entity(entity) is None:
            raise FeatureStoreError(f"404 EntityNotFound: {entity}")
        if embedding_field_type not in _TYPES:
            raise FeatureStoreError(f"400 InvalidFieldType: {embedding_field_type}")
        if not 1 <= int(shard_count) <= 20 or not 1 <= int(replication_count) <= 3:
            raise FeatureStoreError("400 InvalidParameter: shard_count or replication_count")
        try:
            self._conn.execute(
                "INSERT INTO views VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    self.name,
                    name,
                    entity,
                    pk_field_name,
                    sk_field_name,
                    embedding_field_name,
                    pk_field_type,
                    sk_field_type,
                    embedding_field_type,
                    int(ttl),
                    int(shard_count),
                    int(replication_count),
                ),
            )
        except Exception as e:
            raise FeatureStoreError(f"409 FeatureViewAlreadyExists: {name}") from e
        if race is not None:  # another job's create won: this call sees the conflict
            raise FeatureStoreError(f"409 FeatureViewAlreadyExists: {name}")
        view = self.get_dynamic_embedding_feature_view(name)
        assert view is not None
        return view


class ControlPlaneProject(Project):
    """A project of an SDK that also reads control-plane metadata (``get_feature_view``)."""

    def get_feature_view(self, name: str) -> FeatureView | None:
        """Control-plane metadata of view ``name``, or None."""
        _fault(self._conn, "get_feature_view")
        row = self._view_row(name)
        return FeatureView(row) if row else None


class UntypedDynamicEmbeddingFeatureView:
    """The view handle of an SDK older than 2.2.8: no ``embedding_field_type``, no Arrow writes.

    Reader and asynchronous batched writer of one DynamicEmbedding view.
    """

    def __init__(self, conn: Any, project: str, row: tuple[Any, ...]) -> None:
        self._conn = conn
        self._project = project
        self.name = row[1]
        self.pk_field, self.sk_field, self.embedding_field = row[3], row[4], row[5]
        self._type = row[8]
        self._batch_size = 1000
        self._max_workers = 4
        self._queued: list[tuple[str, int, list[dict[str, Any]]]] = []
        self._lock = threading.Lock()
        self._closed = False

    def _check_value(self, value: Any) -> list[Any]:
        if not isinstance(value, (list, tuple)):
            raise FeatureStoreError(f"400 InvalidValue: {self.embedding_field} must be a list")
        out = list(value)
        for v in out:
            if self._type == "ARRAY<UINT8>":
                if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 255:
                    raise FeatureStoreError(f"400 InvalidValue: {v!r} is not a UINT8")
            elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise FeatureStoreError(f"400 InvalidValue: {v!r} is not a FLOAT")
        return out

    def write_features(
        self, data: list[dict[str, Any]], version: str, write_mode: str, ts: int
    ) -> None:
        """Enqueue one HTTP batch of rows (``{pk, sk, embedding}`` dicts)."""
        if self._closed:
            raise RuntimeError("the writer is closed")
        _fault(self._conn, "write_features")
        self._enqueue(data, version, write_mode, ts)

    def _enqueue(self, data: list[dict[str, Any]], version: str, write_mode: str, ts: int) -> None:
        if write_mode not in _WRITE_MODES:
            raise FeatureStoreError(f"400 InvalidWriteMode: {write_mode}")
        if not isinstance(version, str) or not version or version == "default":
            raise FeatureStoreError("400 InvalidVersion: an explicit version is required")
        if isinstance(ts, bool) or not isinstance(ts, int):
            raise TypeError("ts must be an int (milliseconds)")
        if not isinstance(data, list) or len(data) > self._batch_size:
            raise FeatureStoreError(f"400 BatchTooLarge: at most {self._batch_size} rows")
        fields = {self.pk_field, self.sk_field, self.embedding_field}
        rows = []
        for row in data:
            if not isinstance(row, dict) or set(row) != fields:
                raise FeatureStoreError(
                    f"400 InvalidFields: {sorted(row)} are not {sorted(fields)}"
                )
            sk = row[self.sk_field]
            if isinstance(sk, bool) or not isinstance(sk, int):
                raise FeatureStoreError(f"400 InvalidValue: {self.sk_field} {sk!r} is not INT64")
            rows.append(
                {
                    "pk": str(row[self.pk_field]),
                    "sk": sk,
                    "v": self._check_value(row[self.embedding_field]),
                }
            )
        with self._lock:
            self._queued.append((version, ts, rows))

    def write_flush(self) -> dict[str, Any]:
        """Wait for every queued batch; the summary of what was written since the last flush."""
        with self._lock:
            queued, self._queued = self._queued, []
        summary = {
            "total_batches": len(queued),
            "failed_batches": 0,
            "total_records": sum(len(r) for _, _, r in queued),
            "success_records": 0,
            "failed_records": 0,
            "errors": [],
        }
        for version, ts, rows in queued:
            error = fs_state.take_fault(self._conn, "write_flush")
            if error is not None:
                summary["failed_batches"] += 1
                summary["failed_records"] += len(rows)
                summary["errors"].append(error or "503 ServiceUnavailable")
                continue
            for r in rows:
                self._conn.execute(
                    "INSERT INTO rows VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT "
                    "(project, view, version, pk, sk) DO UPDATE SET ts = excluded.ts, "
                    "value = excluded.value WHERE excluded.ts >= rows.ts",
                    (self._project, self.name, version, r["pk"], r["sk"], ts, json.dumps(r["v"])),
                )
            summary["success_records"] += len(rows)
        fs_state.log_call(
            self._conn, "write_flush", {k: v for k, v in summary.items() if k != "errors"}
        )
        return summary

    def get_online_features(
        self, feature_name: str, keys: list[int], version: str
    ) -> list[dict[str, Any]]:
        """Rows of ``keys`` of ``feature_name`` (``{"sk": "42", embedding: [...]}``)."""
        _fault(self._conn, "get_online_features")
        if len(keys) > self._batch_size:
            raise FeatureStoreError(f"400 TooManyKeys: at most {self._batch_size}")
        out = []
        for k in keys:
            if isinstance(k, bool) or not isinstance(k, int):
                raise FeatureStoreError(f"400 InvalidValue: key {k!r} is not INT64")
            row = self._conn.execute(
                "SELECT value FROM rows WHERE project = ? AND view = ? AND version = ? AND pk = ? "
                "AND sk = ?",
                (self._project, self.name, version, feature_name, k),
            ).fetchone()
            if row is not None:
                out.append({"sk": str(k), self.embedding_field: json.loads(row[0])})
        return out

    def close(self, wait: bool = True) -> None:
        """Stop the writer (after draining what is queued when ``wait``)."""
        _fault(self._conn, "close")
        if wait:
            self.write_flush()
        self._closed = True


class DynamicEmbeddingFeatureView(UntypedDynamicEmbeddingFeatureView):
    """Reader and asynchronous batched writer of one DynamicEmbedding view (SDK >= 2.2.8)."""

    def __init__(self, conn: Any, project: str, row: tuple[Any, ...]) -> None:
        super().__init__(conn, project, row)
        self.embedding_field_type = row[8]

    def write_features_arrow(self, *, batch: Any, version: str, write_mode: str, ts: int) -> None:
        """Enqueue one HTTP batch given as an Arrow ``RecordBatch`` of the three fields."""
        import pyarrow as pa

        if self._closed:
            raise RuntimeError("the writer is closed")
        _fault(self._conn, "write_features")
        if not isinstance(batch, pa.RecordBatch):
            raise TypeError("batch must be a pyarrow.RecordBatch")
        names = [self.pk_field, self.sk_field, self.embedding_field]
        if batch.schema.names != names:
            raise FeatureStoreError(f"400 InvalidFields: {batch.schema.names} are not {names}")
        if not pa.types.is_string(batch.schema.field(self.pk_field).type) or not pa.types.is_int64(
            batch.schema.field(self.sk_field).type
        ):
            raise FeatureStoreError("400 InvalidFieldType: pk must be STRING and sk INT64")
        value_type = batch.schema.field(self.embedding_field).type
        want = pa.uint8() if self._type == "ARRAY<UINT8>" else pa.float32()
        if not pa.types.is_list(value_type) or value_type.value_type != want:
            raise FeatureStoreError(f"400 InvalidFieldType: {value_type} is not {self._type}")
        self._enqueue(batch.to_pylist(), version, write_mode, ts)
