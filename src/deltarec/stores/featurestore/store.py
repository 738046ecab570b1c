"""Alibaba PAI FeatureStore through its Python SDK ``feature_store_py`` (optional, not on PyPI).

Install the SDK wheel from Alibaba Cloud and ``deltarec[featurestore]`` (docs/featurestore.md).
Opening a ``featurestore://`` store without the SDK fails at once naming it, whatever the
command. The backend is tested against a strict test double of the SDK (``tests/stores/sdk``)
that offers exactly the calls merged TorchEasyRec makes (and, as a variant, those plus
``project.get_feature_view``); it has not run against a live FeatureStore from this repository.

Layout: one **DynamicEmbedding** feature view ``<view>`` of project ``<project>`` holds every
table: primary key ``embedding_name`` (the table id; with ``contract=tzrec`` TorchEasyRec's
name, :mod:`.tzrec`), sub key ``key_id`` (the row key), ``embedding`` the row's
values: ``ARRAY<FLOAT>`` of the decoded row, or with ``contract=tzrec`` for ``int8_rowwise``
tables ``ARRAY<UINT8>`` of the ``dim + 4`` encoded bytes (uint8 codes, fp16 scale, fp16
offset: QUint8RowwiseF16). Rank 0 creates the entity and the view if missing; other ranks wait
for it; an existing view's field names and embedding type are checked when it is opened.

**Rows per run** (docs/runs.md): each run writes under its own FeatureStore ``version``, as
TorchEasyRec's uploader writes under a model version: the first run that registers in the
store gets ``sdk_version`` itself (so a store written before versions were per run keeps its
rows, which belong to that run), every later run ``<sdk_version>@<run>``. The assignment is
kept in the registry. A promote records the promoted run as the one serving each of its
tables (:meth:`~deltarec.stores.base.Registry.serving_runs`); a handle opened without a run
reads the serving run's version and cannot write; :meth:`FeatureStoreStore.serving_versions`
names the version serving clients read.

Writes: ``write_features_arrow`` (or ``write_features`` where the SDK has no Arrow writes) with
``write_mode="MERGE"`` in batches of ``batch_size`` rows (at most the view's ``_batch_size``),
``_max_workers`` batches in flight, then ``write_flush``, whose every summary field is checked;
after a failed attempt the writer is drained and the client rebuilt before the retry. Every
batch carries a timestamp that increases strictly within the process. FeatureStore cannot
delete: an ``op = 1`` row of a ZCH table (an evicted id, or with the dumper's ``zch_misses`` an
id looked up but never admitted) is written with the row passed (its fallback row), as SPEC §5
asks and as TorchEasyRec publishes such ids
(:func:`~deltarec.stores.urlneeds.wants_zch_misses`), and it keeps no versions: the version
guard is the publisher's (parts are published in dump order and never again once their
progress mark is complete), and verify compares rows by value.

Registry: FeatureStore has no place for it, so generations, progress marks, serving pointer,
freshness, each run's version and each table's ``embedding_name`` live in a relational side
store (:attr:`registry`): ``registry=<sqlite or postgresql URL>``, by default a SQLite file
under the artifact root (``<root>/_registry/featurestore-<project>-<view>.db``), which every
step of a pipeline sees. **The fence is transactional**: every write runs inside one registry
transaction that first checks that no newer generation of the run is registered (holding the
run's lock: SQLite's write lock, PostgreSQL's shared advisory lock, against which a
registration takes the exclusive one), then sends and flushes the rows, then records the
progress mark, and commits. A newer generation therefore registers only between two writes of
an older one, never during one, and every write after it is refused before any row is sent.
The remaining window is the commit itself: rows flushed to FeatureStore whose transaction
then fails to commit (a crash) are in the view without their mark and are replayed
(at-least-once; MERGE of the same rows is harmless).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from deltarec.artifacts import codec
from deltarec.artifacts.types import FALLBACK_KEY, TableSpec
from deltarec.errors import BadInputError, ConfigError, StoreError
from deltarec.stores.base import Registry, Store, first_batch
from deltarec.stores.config import FeatureStoreConfig
from deltarec.stores.featurestore.registry import (
    REGISTRY_DIR,
    SIDE_DDL,
    assign_version,
    check_newest,
    default_registry,
    record_names,
    recorded_names,
    registry_location,
)
from deltarec.stores.featurestore.sdk import (
    PK_FIELD,
    SK_FIELD,
    VALUE_FIELD,
    WRITE_MODE,
    Layout,
    Session,
    check_summary,
    import_module,
    sdk_error,
    view_field_type,
)
from deltarec.stores.rows import checked_arrays
from deltarec.stores.types import Capabilities, ProgressMark, ReadResult, RowBatch, ViewInfo, Write


class FeatureStoreStore(Store):
    """The PAI FeatureStore backend (rows in FeatureStore, registry in a relational side store).

    Args:
        config: the parsed ``featurestore://project/view?region=...`` URL.
        artifacts: the artifact root, where the default registry lives (a local path).
        sdk: the ``feature_store_py`` module (default: imported).
        credentials: an object with ``get_credential()`` (default: the Alibaba Cloud chain).
        rank: this process's rank (default: ``$RANK``, else 0); rank 0 creates the view.

    Raises:
        ConfigError: the SDK or ``alibabacloud-credentials`` is not installed (names it), or
            no registry can be found (names what to add).
    """

    kind = "featurestore"
    capabilities = Capabilities(versions=False)

    def __init__(
        self,
        config: FeatureStoreConfig,
        artifacts: str | None = None,
        sdk: Any = None,
        credentials: Any = None,
        rank: int | None = None,
    ) -> None:
        self.config = config
        if config.contract == "tzrec":  # TorchEasyRec reserves key -1 as the invalid key
            self.capabilities = replace(type(self).capabilities, fallback_key=False)
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else int(rank)
        # Every command names a missing SDK, before it looks at anything else.
        sdk = sdk or import_module("feature_store_py", "the FeatureStore SDK wheel")
        if credentials is None:
            import_module("alibabacloud_credentials.client", "alibabacloud-credentials")
        self._lock = threading.RLock()
        self._last_ts = 0
        self._session = Session(config, self.describe(), sdk, credentials)
        self._registry_url, self._registry_file = registry_location(config, artifacts)
        self._side_store: Any = None
        self._run: str | None = None
        self._versions: dict[str, str] = {}
        self._names: dict[tuple[str, str], str] = {}
        self._run_views: dict[str, ViewInfo] = {}  # the run's views (a run's never move)
        self._fence_generation: int | None = None  # of the write in flight (under _lock)
        self._fence_cursor: Any = None

    @property  # type: ignore[override]
    def run(self) -> str | None:
        """See :attr:`Store.run` (the registry's handle follows it)."""
        return self._run

    @run.setter
    def run(self, value: str | None) -> None:
        self._run = value
        self._run_views = {}
        if self._side_store is not None:
            self._side_store.run = value

    def describe(self) -> str:
        """``featurestore://project/view?region=...`` (with the contract when not the default)."""
        c = self.config
        out = f"featurestore://{c.project}/{c.view}?region={c.region}"
        return out + ("&contract=tzrec" if c.contract == "tzrec" else "")

    # ---- registry ------------------------------------------------------------------------
    @property
    def registry(self) -> Registry:
        """The side store's registry (FeatureStore has no place for one)."""
        registry: Registry = self._side
        return registry

    @property
    def _side(self) -> Any:
        """The registry's store, opened on first use (its default SQLite file created then)."""
        if self._side_store is None:
            from deltarec.stores.backends import open_store, store_class
            from deltarec.stores.config import parse_store_url
            from deltarec.stores.sql.relational import RelationalStore

            config = parse_store_url(self._registry_url)
            cls = store_class(config.type)
            if not issubclass(cls, RelationalStore):
                other = open_store(config)
                other.close()
                raise ConfigError(
                    f"{self.describe()}: the registry {other.describe()} must be a sqlite:// or "
                    "postgresql:// store (its transactions fence the writers)"
                )
            if self._registry_file is not None:
                os.makedirs(os.path.dirname(self._registry_file), exist_ok=True)
            c = self.config  # the registry is this view's alone (refused to any other)
            backend: Callable[..., RelationalStore] = cls  # the SQL backends take registry_of
            side = backend(
                config, registry_of=f"featurestore://{c.project}/{c.view}?region={c.region}"
            )
            side.run = self._run
            with side.transaction() as cur:
                for ddl in SIDE_DDL:
                    side.execute(cur, ddl)
            self._side_store = side
        return self._side_store

    def _registry_exists(self) -> bool:
        return self._side_store is not None or (
            self._registry_file is None or os.path.exists(self._registry_file)
        )

    def version_of(self, run: str, assign: bool = False) -> str | None:
        """The FeatureStore ``version`` ``run`` writes under (None: none assigned yet).

        With ``assign`` a run without one gets one (:func:`~deltarec.stores.featurestore.registry.
        assign_version`): ``sdk_version`` for the store's first run, else
        ``<sdk_version>@<run>``.
        """
        if run not in self._versions:
            version = assign_version(self._side, run, self.config.sdk_version, assign)
            if version is None:
                return None
            self._versions[run] = version
        return self._versions[run]

    def serving_versions(self) -> dict[str, str]:
        """Table id -> the FeatureStore ``version`` serving reads it from (the promoted run's).

        The first run that provisions a table serves it until another run is promoted.
        """
        out = {}
        for table, run in self._side.serving_runs().items():
            version = self.version_of(run)
            if version is not None:
                out[table] = version
        return out

    # ---- views ---------------------------------------------------------------------------
    def provision(
        self, tables: Mapping[str, TableSpec], staging_generation: int | None = None
    ) -> dict[str, ViewInfo]:
        """Create (rank 0) or open the view, check it, and record the run's tables and version.

        The FeatureStore view is created and checked before anything is recorded; a provision
        that fails leaves no registry file behind where it created the registry.

        Raises:
            ViewMismatchError: the view's fields, or a table's recorded dim or dtype, differ.
            ConfigError: the tables need two embedding field types in one view, or
                (``contract=tzrec``) a table's module type is not known.
        """
        if staging_generation:
            raise self._unsupported("staging views (use publish mode 'direct')")
        run = self._writer("provisioning views")
        layouts = {t: Layout.of(t, s, self.config.contract) for t, s in tables.items()}
        names: dict[str, str] = {}
        for lay in layouts.values():
            if names.setdefault(lay.name, lay.table) != lay.table:
                raise BadInputError(
                    f"{self.describe()}: tables {names[lay.name]!r} and {lay.table!r} have "
                    f"one embedding_name {lay.name!r}"
                )
        existed = self._registry_exists()
        try:
            known = {  # their field types; names do not matter here
                t: Layout.of(t, TableSpec(v.dim, v.dtype), self.config.contract, name=t)
                for t, v in (self.views().items() if existed else ())
            }
            field_type = view_field_type({**known, **layouts}, self.describe())
            self._open(field_type)
            side = self._side
            recorded = side.provision(tables)
            record_names(side, run, {t: lay.name for t, lay in layouts.items()}, self.describe())
            self.version_of(run, assign=True)
            self._run_views = {}
        except BaseException:
            if not existed:
                self._remove_registry()
            raise
        return {
            t: ViewInfo(t, self.config.view, v.dim, v.dtype, run=run) for t, v in recorded.items()
        }

    def _remove_registry(self) -> None:
        """Close and delete a registry file this handle created (a failed provision)."""
        if self._side_store is not None:
            with contextlib.suppress(Exception):
                self._side_store.close()
            self._side_store = None
        path = self._registry_file
        if path is None:
            return
        for leftover in (path, f"{path}-wal", f"{path}-shm", f"{path}-journal"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(leftover)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(path))  # only if empty

    def views(self, staging_generation: int | None = None) -> dict[str, ViewInfo]:
        """The handle's run's tables (without a run: the served ones), from the registry."""
        if staging_generation:
            return {}
        if not self._registry_exists():
            return {}
        return {
            t: ViewInfo(t, self.config.view, v.dim, v.dtype, run=v.run)
            for t, v in self._side.views().items()
        }

    def _layout(self, table: str, view: ViewInfo) -> Layout:
        """The layout of a provisioned table, under the ``embedding_name`` recorded for it."""
        run = view.run or self.run or ""
        if (run, table) not in self._names:
            self._names.update({(run, t): n for t, n in recorded_names(self._side, run).items()})
        spec = TableSpec(view.dim, view.dtype)
        return Layout.of(table, spec, self.config.contract, self._names.get((run, table)))

    def _table(self, table: str) -> tuple[Layout, str]:
        """The layout of ``table`` and the version to use (the run's, or the serving run's)."""
        views = self._run_views if self.run is not None and table in self._run_views else None
        if views is None:  # a handle without a run follows promotes: never cached
            views = self.views()
            if self.run is not None:
                self._run_views = views
        if table not in views:
            whose = f"of run {self.run!r} " if self.run else "served by any run "
            raise BadInputError(
                f"table {table!r} {whose}is not provisioned in {self.describe()}; "
                "run `deltarec provision`"
            )
        view = views[table]
        run = self.run or view.run
        # A run provisioned before versions were per run gets its version on first use.
        version = self.version_of(run, assign=True) if run else None
        if version is None:
            raise BadInputError(
                f"table {table!r}: run {run!r} has no FeatureStore version in "
                f"{self.describe()}; run `deltarec provision --run {run}`"
            )
        return self._layout(table, view), version

    def _open(self, field_type: str | None) -> Any:
        return self._session.open_view(field_type, self.rank)

    def _next_ts(self) -> int:
        with self._lock:
            self._last_ts = max(time.time_ns() // 1_000_000, self._last_ts + 1)
            return self._last_ts

    # ---- rows ----------------------------------------------------------------------------
    def apply(self, write: Write) -> int:
        """MERGE the rows under one fence (one registry transaction), then ``mark``.

        ``op = 1`` rows are written as given (the fallback row); :meth:`write` is a call with one
        batch. See the module docstring for the fence. Raises:
            StaleGenerationError: a newer generation of the run is registered (nothing sent).
            StoreUnavailableError: a transient failure (the writer was drained and the client is
                rebuilt on the next call, with fresh credentials).
            StoreError: a failure retrying cannot fix (names the view, the table, the fix).
        """
        table, batches, mark, staging_generation = write
        if staging_generation:
            raise self._unsupported("staging views")
        run = self._writer("writing rows")
        self._check_mark(mark)
        lay, version = self._table(table)
        info = ViewInfo(table, self.config.view, lay.spec.dim, lay.spec.dtype)
        first, rest = first_batch(table, batches)
        total = 0
        with self._fenced(run, first, mark):
            for batch in _chain(first, rest):
                keys, _, vers = checked_arrays(table, info, *batch)
                embedding = np.asarray(batch.embedding)
                self._check_generation(run, vers, mark)
                total += int(keys.shape[0])
                if not self.capabilities.fallback_key:
                    keep = keys != FALLBACK_KEY
                    keys, embedding = keys[keep], embedding[keep]
                if len(keys):
                    self._send(lay, version, keys, embedding)
        return total

    @contextlib.contextmanager
    def _fenced(self, run: str, first: RowBatch, mark: ProgressMark | None) -> Iterator[None]:
        """One registry transaction around a write: the fence first, the mark last."""
        side = self._side
        self._fence_generation = _generation_of(first, mark)
        with self._lock, side.transaction() as cur:
            side.lock_run(cur, run, shared=True)
            self._fence_cursor = cur
            if self._fence_generation is not None:
                check_newest(side, cur, run, self._fence_generation)
            yield
            if mark is not None:
                side.write_mark(cur, mark, 0)

    def _check_generation(self, run: str, versions: np.ndarray, mark: ProgressMark | None) -> None:
        """Rows of a later batch may name a newer generation than the first: fence it too."""
        if mark is None and len(versions):
            generation = int(np.max(versions)) >> 32
            if self._fence_generation is None or generation > self._fence_generation:
                self._fence_generation = generation
                check_newest(self._side, self._fence_cursor, run, generation)

    def _send(self, lay: Layout, version: str, keys: np.ndarray, embedding: np.ndarray) -> None:
        view = self._open(lay.field_type)
        where = self._session.where(f"write {len(keys)} rows", lay.table)
        arrow = getattr(view, "write_features_arrow", None)
        try:
            batch = min(self.config.batch_size, int(getattr(view, "_batch_size", 1000)))
            window = max(1, int(getattr(view, "_max_workers", 1)))
            starts = list(range(0, len(keys), batch))
            for w in range(0, len(starts), window):
                sent = 0
                for s in starts[w : w + window]:
                    k, e = keys[s : s + batch], embedding[s : s + batch]
                    ts = self._next_ts()
                    if arrow is not None:
                        arrow(batch=lay.arrow(k, e), version=version, write_mode=WRITE_MODE, ts=ts)
                    else:
                        data = [
                            {PK_FIELD: lay.name, SK_FIELD: key, VALUE_FIELD: value}
                            for key, value in zip(k.tolist(), lay.values(e), strict=True)
                        ]
                        view.write_features(
                            data=data, version=version, write_mode=WRITE_MODE, ts=ts
                        )
                    sent += len(k)
                batches = len(starts[w : w + window])
                check_summary(view.write_flush(), sent, batches, where)
        except Exception as e:
            # A write call may have queued part of its work before failing: drain it and start
            # the next attempt on a new client, so a retry never mixes with it.
            self._session.reset()
            raise sdk_error(e, where) from e

    def read(
        self, table: str, keys: np.ndarray, staging_generation: int | None = None
    ) -> ReadResult:
        """Read rows back with ``get_online_features`` (no versions are stored: 0).

        A handle of a run reads that run's version; one without a run the serving run's.
        """
        if staging_generation:
            raise self._unsupported("staging views")
        lay, version = self._table(table)
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
                rows = view.get_online_features(feature_name=lay.name, keys=chunk, version=version)
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
            if self._side_store is not None:
                self._side_store.close()

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


def _chain(first: RowBatch, rest: Iterator[RowBatch]) -> Iterator[RowBatch]:
    yield first
    yield from rest


def _generation_of(batch: RowBatch, mark: ProgressMark | None) -> int | None:
    """The generation a write belongs to: its mark's, else the newest its rows' versions name."""
    if mark is not None:
        return mark.generation
    versions = np.asarray(batch.versions)
    return int(np.max(versions)) >> 32 if versions.size else None


__all__ = [
    "REGISTRY_DIR",
    "FeatureStoreStore",
    "default_registry",
]
