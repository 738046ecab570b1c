"""The PAI FeatureStore SDK as deltarec calls it: clients, the view, error classes, layouts.

The calls are exactly those merged TorchEasyRec makes (``tzrec/utils/
feature_store_delta_uploader.py``, ``tzrec/tools/feature_store/check_feature_store_delta.py``):
``FeatureStoreClient(...).get_project(...)``, ``get_entity``/``create_entity``,
``get_dynamic_embedding_feature_view``, ``create_dynamic_embedding_feature_view``; on the view
handle its attributes ``pk_field``, ``sk_field``, ``embedding_field``, ``embedding_field_type``
(absent on a legacy float view or an SDK older than 2.2.8), ``_batch_size``, ``_max_workers``,
and ``write_features_arrow(batch=, version=, write_mode="MERGE", ts=)`` (or, where the SDK has
no Arrow writes, ``write_features(data=, ...)``), ``write_flush()``,
``get_online_features(feature_name=, keys=, version=)``, ``close(wait=True)``.
``project.get_feature_view`` (control-plane metadata) is used only where the SDK has it, for
the view's TTL, shard and replica checks; it is never required.

* **Credentials** come from the Alibaba Cloud default credential chain
  (``alibabacloud_credentials``: environment, profile file, ECS/RRSA role...), fetched again
  each time a client is built, since STS tokens expire; FeatureDB login from
  ``FEATUREDB_USERNAME``/``FEATUREDB_PASSWORD``. Nothing secret is logged or kept in configs.
* **Errors** are classified (:func:`sdk_error`): throttling, 5xx, network errors and an
  expired security token become :class:`~deltarec.errors.StoreUnavailableError` (the caller
  retries with bounded backoff, on a new client); authentication and schema errors fail at once
  with a :class:`~deltarec.errors.StoreError` naming the view, the table and what to fix.
* **Layouts** (:class:`Layout`): the ``embedding_name`` and the value list of each table, in
  deltarec's own contract or TorchEasyRec's (``contract=tzrec``, :mod:`.tzrec`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from deltarec.artifacts import codec
from deltarec.artifacts.types import DType, TableSpec
from deltarec.errors import (
    ConfigError,
    DeltarecError,
    StoreError,
    StoreUnavailableError,
    ViewMismatchError,
)
from deltarec.stores.config import FeatureStoreConfig
from deltarec.stores.errors import DriverErrors
from deltarec.stores.featurestore.tzrec import tzrec_embedding_name
from deltarec.stores.urlneeds import import_module

log = logging.getLogger(__name__)

PK_FIELD = "embedding_name"
SK_FIELD = "key_id"
VALUE_FIELD = "embedding"
WRITE_MODE = "MERGE"
FLOAT_TYPE = "ARRAY<FLOAT>"
UINT8_TYPE = "ARRAY<UINT8>"
SUMMARY_FIELDS = ("total_batches", "failed_batches", "total_records", "success_records",
                  "failed_records")  # fmt: skip

_RETRY_WORDS = re.compile(
    r"throttl|too many requests|serviceunavailable|service unavailable|internalerror|"
    r"internal error|timeout|timed out|temporar|securitytokenexpired|token expired|"
    r"connection (reset|refused|aborted)",
    re.I,
)
_AUTH_WORDS = re.compile(
    r"invalidaccesskey|signaturedoesnotmatch|forbidden|unauthori[sz]ed|nopermission|"
    r"access denied|accessdenied|invalidsecuritytoken|authentication|password",
    re.I,
)
_HTTP = re.compile(r"\b([45]\d\d)\b")
_PROVISIONING = {
    "ttl_s": "ttl",
    "shard_count": "shard_count",
    "replication_count": "replication_count",
}
"""A view's provisioning settings: the config's option -> the key of the view's ``Config``."""


def _status(e: BaseException) -> int:
    """The HTTP status an SDK error names (0: none)."""
    code = _HTTP.search(str(e))
    return int(code.group(1)) if code else 0


def _transient(e: BaseException) -> bool:
    """Throttling, 5xx, network errors, an expired STS token: a retry can fix them."""
    status = _status(e)
    if isinstance(e, (ConnectionError, TimeoutError, OSError)) or status == 429 or status >= 500:
        return True
    return bool(_RETRY_WORDS.search(str(e)))


def _advice(e: BaseException) -> str:
    """What to fix for an authentication or schema error."""
    status = _status(e)
    if status in (401, 403) or _AUTH_WORDS.search(str(e)):
        return (
            "authentication failed; check the Alibaba Cloud credentials "
            "(ALIBABA_CLOUD_ACCESS_KEY_ID/ALIBABA_CLOUD_ACCESS_KEY_SECRET, "
            "ALIBABA_CLOUD_SECURITY_TOKEN, or the role of the credential chain) and "
            "FEATUREDB_USERNAME/FEATUREDB_PASSWORD"
        )
    if status == 400 or isinstance(e, (TypeError, ValueError, KeyError)):
        return (
            "the request does not fit the view's schema or the SDK's contract; check that the "
            f"view was created for these tables (fields {PK_FIELD}/{SK_FIELD}/{VALUE_FIELD}) "
            "and the SDK version"
        )
    return ""


_ERRORS = DriverErrors(Exception, _transient, _advice)
"""The SDK raises plain exceptions (its own, the HTTP client's, the builtins)."""


def sdk_error(e: BaseException, where: str) -> DeltarecError:
    """The deltarec error for an exception the SDK raised while doing ``where``.

    ``where`` names the view and, where there is one, the table. Transient errors become
    :class:`StoreUnavailableError` (retried); others :class:`StoreError` saying what to fix.
    """
    if isinstance(e, DeltarecError):
        return e
    return _ERRORS.store_error(where, e)


# ---- layouts ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """How one table's rows are stored in the view.

    Attributes:
        table: the table id.
        name: its ``embedding_name``.
        spec: its spec (dim, dtype).
        field_type: the view's embedding field type the values need.
    """

    table: str
    name: str
    spec: TableSpec
    field_type: str

    @classmethod
    def of(cls, table: str, spec: TableSpec, contract: str, name: str | None = None) -> Layout:
        """The layout of ``table`` under ``contract`` (``deltarec`` or ``tzrec``).

        ``name`` is the table's recorded ``embedding_name``; by default the table id, or with
        ``contract=tzrec`` TorchEasyRec's name from the spec (:func:`tzrec_embedding_name`).
        """
        if name is None:
            name = tzrec_embedding_name(table, spec) if contract == "tzrec" else table
        return cls(table, name, spec, cls.field_type_of(spec, contract))

    @staticmethod
    def field_type_of(spec: TableSpec, contract: str) -> str:
        """The embedding field type a table's rows need: UINT8 for int8 under ``tzrec``."""
        raw = contract == "tzrec" and DType(spec.dtype) is DType.INT8_ROWWISE
        return UINT8_TYPE if raw else FLOAT_TYPE

    @property
    def width(self) -> int:
        """Values per stored row."""
        if self.field_type == UINT8_TYPE:
            return codec.encoded_width(self.spec.dtype, self.spec.dim)
        return self.spec.dim

    def values(self, encoded: np.ndarray) -> list[list[Any]]:
        """The value lists to send for encoded rows ``[n, encoded_width]``."""
        if self.field_type == UINT8_TYPE:
            return np.asarray(encoded, np.uint8).tolist()  # type: ignore[no-any-return]
        decoded = codec.decode(encoded, self.spec.dtype, self.spec.dim)
        return np.asarray(decoded, np.float32).tolist()  # type: ignore[no-any-return]

    def arrow(self, keys: np.ndarray, encoded: np.ndarray) -> Any:
        """The Arrow batch of rows ``keys`` (``write_features_arrow``: pk, sk, embedding)."""
        import pyarrow as pa

        if self.field_type == UINT8_TYPE:
            flat, value_type = np.asarray(encoded, np.uint8), pa.uint8()
        else:
            decoded = codec.decode(encoded, self.spec.dtype, self.spec.dim)
            flat, value_type = np.asarray(decoded, np.float32), pa.float32()
        values = pa.FixedSizeListArray.from_arrays(
            pa.array(flat.reshape(-1), value_type), flat.shape[1]
        ).cast(pa.list_(value_type))
        return pa.RecordBatch.from_arrays(
            [pa.array([self.name] * len(keys), pa.string()), pa.array(keys, pa.int64()), values],
            names=[PK_FIELD, SK_FIELD, VALUE_FIELD],
        )

    def encoded(self, value: Any, key: int, where: str) -> np.ndarray:
        """The encoded row of one value list read back (raises naming the key if malformed)."""
        if self.field_type == UINT8_TYPE:
            arr = np.asarray(value, np.int64)
            if arr.shape != (self.width,) or (arr < 0).any() or (arr > 255).any():
                raise StoreError(
                    f"{where}: key {key} of {self.table!r} holds {len(value)} values that are "
                    f"not the {self.width} bytes of an int8_rowwise row of dim {self.spec.dim}"
                )
            return arr.astype(np.uint8)
        row = np.asarray(value, np.float32).reshape(1, -1)
        if row.shape[1] != self.spec.dim:
            raise StoreError(
                f"{where}: key {key} of {self.table!r} holds {row.shape[1]} values, the table "
                f"has dim {self.spec.dim}"
            )
        return codec.encode(row, self.spec.dtype)[0]


def view_field_type(layouts: dict[str, Layout], where: str) -> str:
    """The one embedding field type ``layouts`` need in their shared view (names a conflict)."""
    types = {lay.field_type for lay in layouts.values()}
    if len(types) > 1:
        by = {
            t: sorted(lay.table for lay in layouts.values() if lay.field_type == t) for t in types
        }
        raise ConfigError(
            f"{where}: one view holds one embedding field type, but tables "
            f"{by.get(FLOAT_TYPE)} need {FLOAT_TYPE} and {by.get(UINT8_TYPE)} need "
            f"{UINT8_TYPE}; publish them to two views (two store URLs)"
        )
    return types.pop() if types else FLOAT_TYPE


# ---- the SDK session --------------------------------------------------------------------------
class Session:
    """One SDK client and the view it writes and reads; rebuilt after an error.

    Args:
        config: the store's config.
        describe: the store's URL (for messages).
        sdk: the ``feature_store_py`` module (default: imported).
        credentials: an object with ``get_credential()`` (default: the Alibaba Cloud default
            credential chain, ``alibabacloud_credentials.client.Client()``).
    """

    def __init__(
        self, config: FeatureStoreConfig, describe: str, sdk: Any = None, credentials: Any = None
    ) -> None:
        self.config = config
        self.describe = describe
        self._sdk = sdk
        self._credentials = credentials
        self.project: Any = None
        self.view: Any = None

    def where(self, what: str, table: str | None = None) -> str:
        """``featurestore://p/v?... view 'v' table 't': what`` for messages."""
        t = f" table {table!r}" if table else ""
        return f"{self.describe} view {self.config.view!r}{t}: {what}"

    def connect(self) -> Any:
        """The project, building a client with freshly fetched credentials."""
        if self.project is not None:
            return self.project
        sdk = self._sdk or import_module("feature_store_py", "the FeatureStore SDK wheel")
        chain = self._credentials
        if chain is None:
            creds = import_module("alibabacloud_credentials.client", "alibabacloud-credentials")
            chain = creds.Client()
        c = self.config
        region = c.region
        user = os.environ.get("FEATUREDB_USERNAME") or None
        password = os.environ.get("FEATUREDB_PASSWORD") or None
        if bool(user) != bool(password):
            raise ConfigError("set both FEATUREDB_USERNAME and FEATUREDB_PASSWORD, or neither")
        try:
            cred = chain.get_credential()
            client = sdk.FeatureStoreClient(
                access_key_id=cred.access_key_id,
                access_key_secret=cred.access_key_secret,
                region=region,
                endpoint=c.endpoint,
                security_token=getattr(cred, "security_token", None) or None,
                featuredb_username=user,
                featuredb_password=password,
            )
            project = client.get_project(c.project)
        except Exception as e:
            raise sdk_error(e, self.where("connect")) from e
        if project is None:
            raise ConfigError(f"{self.describe}: FeatureStore project {c.project!r} not found")
        self.project = project
        return project

    def open_view(self, field_type: str | None, rank: int) -> Any:
        """The DynamicEmbedding view, created if missing (rank 0), its fields checked.

        ``field_type`` is the embedding field type the tables need (None: whatever the view
        has, for a store that only reads). Other ranks wait for rank 0's view.

        Raises:
            ViewMismatchError: the view's fields, entity or embedding type are not what deltarec
                writes (names both).
        """
        if self.view is not None:
            return self.view
        project = self.connect()
        c = self.config
        deadline = time.monotonic() + c.create_wait_s
        while True:
            view = self._call(lambda: project.get_dynamic_embedding_feature_view(c.view), "open")
            if view is not None or field_type is None:
                break
            if rank == 0:
                view = self._create(project, field_type)
                break
            if time.monotonic() > deadline:
                raise StoreUnavailableError(
                    self.where(f"rank {rank} waited {c.create_wait_s:.0f}s for rank 0 to create it")
                )
            time.sleep(min(1.0, c.create_wait_s / 10))
        if view is None:
            raise StoreError(
                self.where("the view does not exist; run `deltarec provision` (or publish) first")
            )
        self._check(project, view, field_type)
        self.view = view
        return view

    def _create(self, project: Any, field_type: str) -> Any:
        c = self.config
        if self._call(lambda: project.get_entity(c.entity), "look up the entity") is None:
            try:
                project.create_entity(c.entity, f"{c.entity}_id")
            except Exception as e:  # another job may have created it meanwhile
                if self._call(lambda: project.get_entity(c.entity), "entity") is None:
                    raise sdk_error(e, self.where(f"create entity {c.entity!r}")) from e
        kwargs: dict[str, Any] = dict(
            name=c.view,
            entity=c.entity,
            pk_field_name=PK_FIELD,
            sk_field_name=SK_FIELD,
            embedding_field_name=VALUE_FIELD,
            pk_field_type="STRING",
            sk_field_type="INT64",
            ttl=c.ttl_s,
            shard_count=c.shard_count,
            replication_count=c.replication_count,
        )
        if field_type != FLOAT_TYPE:  # an SDK older than 2.2.8 lacks the keyword: float only
            kwargs["embedding_field_type"] = field_type
        try:
            return project.create_dynamic_embedding_feature_view(**kwargs)
        except TypeError as e:
            raise ConfigError(
                self.where(
                    "the installed feature_store_py does not accept embedding_field_type "
                    f"({e}); {field_type} views need feature_store_py >= 2.2.8"
                )
            ) from e
        except Exception as e:  # created concurrently by another job: pick it up
            view = self._call(lambda: project.get_dynamic_embedding_feature_view(c.view), "open")
            if view is None:
                raise sdk_error(e, self.where("create the view")) from e
            return view

    def _check(self, project: Any, view: Any, field_type: str | None) -> None:
        """Check the view handle's fields, embedding type and writer settings.

        Where the SDK reads control-plane metadata (``get_feature_view``), the view's type,
        field types and provisioning (TTL, shards, replicas) are checked too.
        """
        c = self.config
        fields = (view.pk_field, view.sk_field, view.embedding_field)
        if fields != (PK_FIELD, SK_FIELD, VALUE_FIELD):
            raise ViewMismatchError(
                c.view, f"fields {fields}", f"fields {(PK_FIELD, SK_FIELD, VALUE_FIELD)}"
            )
        have = handle_field_type(view)
        if field_type is not None and have is None and field_type != FLOAT_TYPE:
            raise ViewMismatchError(
                c.view,
                "a view without embedding_field_type (a legacy float view, or an SDK older than "
                f"feature_store_py 2.2.8), which holds {FLOAT_TYPE} rows only",
                f"{field_type} for int8_rowwise rows under contract=tzrec; publish the int8 "
                "tables to a view created by feature_store_py >= 2.2.8 (another view name), or "
                "as float rows (row_encodings float32)",
            )
        if field_type is not None and have is not None and have != field_type:
            raise ViewMismatchError(
                c.view, f"embedding_field_type {have}", f"embedding_field_type {field_type}"
            )
        for attr, default in (("_batch_size", 1000), ("_max_workers", 1)):
            value = getattr(view, attr, default)
            if type(value) is not int or value < 1:
                raise StoreError(
                    self.where(f"the SDK's view handle has {attr} {value!r}, not a positive int")
                )
        read_meta = getattr(project, "get_feature_view", None)
        if read_meta is None:  # merged TorchEasyRec's SDK surface: the handle is all there is
            given = sorted(o for o in _PROVISIONING if o in c.model_fields_set)
            if given:
                log.warning(
                    "%s: the SDK reads no control-plane metadata (get_feature_view), so the "
                    "view's %s cannot be checked against the URL's",
                    self.describe,
                    ", ".join(given),
                )
            return
        meta = self._call(lambda: read_meta(c.view), "read the view's schema")
        if meta is None:
            log.info("%s: the SDK returns no control-plane metadata for the view", self.describe)
            return
        if getattr(meta, "type", None) != "DynamicEmbedding":
            raise ViewMismatchError(c.view, f"type {meta.type!r}", "type 'DynamicEmbedding'")
        types = {
            k: (v or {}).get("Type") for k, v in (getattr(meta, "fields_dict", None) or {}).items()
        }
        wanted = {PK_FIELD: "STRING", SK_FIELD: "INT64"}
        if field_type is not None:
            wanted[VALUE_FIELD] = field_type
        got = {k: types.get(k) for k in wanted}
        if got != wanted:
            raise ViewMismatchError(
                c.view, f"field types {got}", f"field types {wanted} (what deltarec writes)"
            )
        self._check_provisioning(meta)

    def _check_provisioning(self, meta: Any) -> None:
        """An existing view's TTL, shard and replica counts against the configured ones.

        A setting given explicitly (in the store URL) that the view does not have is refused
        with both named: a view that drops rows after 7 days where 15 were asked for would
        lose rows silently. A setting left at its default takes the view's own value (logged).
        """
        c = self.config
        summary = getattr(meta, "summary", None)
        raw = summary.get("Config") if isinstance(summary, dict) else None
        try:
            have = json.loads(raw) if isinstance(raw, str) else dict(raw or {})
        except (TypeError, ValueError):
            have = {}
        if not have:
            log.info("%s: the view reports no provisioning settings to check", self.describe)
            return
        for option, key in _PROVISIONING.items():
            want, got = getattr(c, option), have.get(key)
            if got is None or int(got) == int(want):
                continue
            if option in c.model_fields_set:
                raise ViewMismatchError(c.view, f"{key} {got}", f"{key} {want} ({option})")
            log.info("%s: the view has %s %s (the default is %s)", self.describe, key, got, want)

    def field_type(self) -> str:
        """The embedding field type of the open view (a view that reports none is float)."""
        return handle_field_type(self.open_view(None, 0)) or FLOAT_TYPE

    def _call(self, fn: Any, what: str) -> Any:
        try:
            return fn()
        except Exception as e:
            raise sdk_error(e, self.where(what)) from e

    def reset(self) -> None:
        """Drop the client and view (after an error), draining the writer; never raises."""
        view, self.view, self.project = self.view, None, None
        if view is not None:
            with contextlib.suppress(Exception):  # the next client starts clean either way
                view.close(wait=True)


def handle_field_type(view: Any) -> str | None:
    """The view handle's ``embedding_field_type``; None where it reports none (legacy float)."""
    value = getattr(view, "embedding_field_type", None)
    return str(value) if value else None


def check_summary(summary: Any, records: int, batches: int, where: str) -> None:
    """Check every field of a ``write_flush()`` summary against what was sent.

    Raises:
        StoreUnavailableError: batches or records failed (retried: a throttled or failed HTTP
            batch), unless an error says authentication.
        StoreError: the summary is malformed, or counts what was not sent.
    """
    if not isinstance(summary, dict) or not all(k in summary for k in SUMMARY_FIELDS):
        raise StoreError(f"{where}: write_flush returned {summary!r}, not a summary")
    n = {k: int(summary[k]) for k in SUMMARY_FIELDS}
    errors = summary.get("errors") or []
    if n["failed_batches"] or n["failed_records"]:
        err = sdk_error(RuntimeError("; ".join(map(str, errors[:3])) or "failed"), where)
        text = (
            f"{where}: {n['failed_records']} of {n['total_records']} records in "
            f"{n['failed_batches']} of {n['total_batches']} batches failed: {errors[:3]}"
        )
        if isinstance(err, StoreError) and not isinstance(err, StoreUnavailableError):
            raise StoreError(f"{text}; {err}")
        raise StoreUnavailableError(text)
    if (n["total_batches"], n["total_records"], n["success_records"]) != (
        batches,
        records,
        records,
    ):
        raise StoreError(
            f"{where}: write_flush counted {n['total_batches']} batches and "
            f"{n['success_records']} of {n['total_records']} records, but {batches} batches of "
            f"{records} records were sent"
        )


__all__ = [
    "Layout",
    "Session",
    "check_summary",
    "handle_field_type",
    "sdk_error",
    "tzrec_embedding_name",
    "view_field_type",
]
