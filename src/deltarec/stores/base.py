"""The store interface (SPEC §5): rows (:class:`Store`) and control plane (:class:`Registry`).

A :class:`Store` holds, per tracked table, a **view** (table, hash, feature view) of ``key ->
(encoded row, version)``: the rows. A :class:`Registry` holds the control plane: generations it
has seen, progress marks, the serving pointer, freshness records and the bookkeeping of
snapshots and staging. The SQL stores and Redis are both; FeatureStore composes its rows with a
registry kept elsewhere. The rules built on the two (when a snapshot is complete) live in
:mod:`deltarec.publish`, once.

Contract of every backend:

* **Versioned upsert.** A row is applied only if its version is >= the stored one, and >= the
  view's floor (set by a snapshot) and > the key's tombstone. Replays are harmless; a late
  writer never overwrites a newer row.
* **Deletes.** ``op = 1`` deletes the key and leaves a tombstone with its version where
  ``capabilities.deletes``; a late older upsert never resurrects it. Elsewhere the row passed
  (the fallback row) is written like an upsert.
* **One call, one transaction.** ``write`` (one batch) and ``write_batches`` (several batches
  streamed in, memory bounded by one batch) apply all of their rows and their progress mark, or
  nothing (where ``capabilities.atomic_marks``).
* **Errors.** Unreachable store: :class:`~deltarec.errors.StoreUnavailableError` (the caller
  retries); invalid rows: :class:`~deltarec.errors.InvalidRowError` before anything is
  written; an unprovisioned table: :class:`~deltarec.errors.BadInputError`; anything else
  that retrying cannot fix: :class:`~deltarec.errors.StoreError`.

* **Rows per run** (docs/runs.md). A store handle belongs to one run (``open_store(url,
  run=...)``, :attr:`Store.run`): its views are that run's own, so versions, which order one
  run's lineage only, never compare rows of two runs. Each table's **serving name** reads the
  rows of the run promoted last (:meth:`Registry.set_serving` moves it); a handle opened without
  a run reads through the serving names and cannot write.

Stores are used from one thread at a time; backends that may be shared between threads lock.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from deltarec.artifacts import codec
from deltarec.artifacts.types import TableSpec
from deltarec.errors import BadInputError, StaleGenerationError, UnsupportedError
from deltarec.stores.types import (
    Capabilities,
    FreshnessRecord,
    ProgressMark,
    ReadResult,
    RowBatch,
    ServingPointer,
    SnapshotRecord,
    ViewInfo,
    Write,
)


class Store(abc.ABC):
    """An online store behind one small interface. Open one with :func:`open_store`."""

    kind: ClassVar[str]
    """The registry's short name (``sqlite``, ``postgres``, ``redis``, ``featurestore``)."""
    capabilities: Capabilities
    """What the backend can do (set by each class; an instance may narrow it by its options)."""
    run: str | None = None
    """The run whose views this handle reads and writes (set once, by :func:`open_store`).

    None: the handle reads what serving reads (each table's promoted run) and cannot write.
    """

    # ---- views ---------------------------------------------------------------------------
    @abc.abstractmethod
    def provision(
        self, tables: Mapping[str, TableSpec], staging_generation: int | None = None
    ) -> dict[str, ViewInfo]:
        """Create the views (and the registry) for ``tables``; idempotent.

        With ``staging_generation`` the views are that generation's staging views.

        Returns:
            table id -> the provisioned view.

        Raises:
            ViewMismatchError: a view exists with another dim or dtype (names both).
            BadInputError: two table ids map to one view name, or a name is not safe.
        """

    @abc.abstractmethod
    def views(self, staging_generation: int | None = None) -> dict[str, ViewInfo]:
        """The live views this store holds, by table id.

        With ``staging_generation``: that generation's staging views (none once promote has
        merged them).
        """

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
        """Apply one batch with the versioned-upsert contract, and ``mark`` with it.

        Args:
            table: table id (provisioned).
            keys: int64 ``[n]``, unique within the batch.
            embedding: ``[n, encoded_width]`` encoded rows in the table's dtype.
            ops: int8 ``[n]``; 0 upsert, 1 delete.
            versions: int64 ``[n]``; ``generation << 32 | seq`` of each row.
            mark: progress mark committed with the rows (may be given with ``n == 0``).
            staging_generation: write into that generation's staging view instead.

        Returns:
            The number of rows in the batch (applied or already superseded).
        """
        batch = RowBatch(keys, embedding, ops, versions)
        return self.apply(Write(table, (batch,), mark, staging_generation))

    def write_batches(
        self,
        table: str,
        batches: Iterable[RowBatch],
        mark: ProgressMark | None = None,
        staging_generation: int | None = None,
    ) -> int:
        """Apply several batches as one :meth:`write`: the rows of all, and ``mark`` with them.

        ``batches`` is consumed once, in order, so the caller holds one batch at a time however
        many rows the call writes; at least one batch (it may be empty) must come. Keys are
        unique within the whole call.

        Returns:
            The number of rows in all batches.
        """
        return self.apply(Write(table, batches, mark, staging_generation))

    @abc.abstractmethod
    def apply(self, write: Write) -> int:
        """Apply one :meth:`write` or :meth:`write_batches` call (what a backend implements).

        All rows and the mark, or nothing, where ``capabilities.atomic_marks``. The SQL
        backends apply everything in one transaction, in key order (a B-tree takes a large
        write in random key order several times faster sorted); Redis applies a MULTI/EXEC per
        batch and the mark with the last, so after a failure the rows before the mark are
        replayed, which the versioned upsert makes harmless.

        Returns:
            The number of rows in all batches (applied or already superseded).
        """

    @abc.abstractmethod
    def read(
        self, table: str, keys: np.ndarray, staging_generation: int | None = None
    ) -> ReadResult:
        """Read ``keys`` (int64 ``[n]``) of a view; see :class:`ReadResult`."""

    @abc.abstractmethod
    def scan_keys(self, table: str, batch_rows: int = 65536) -> Iterator[np.ndarray]:
        """Every key of a live view, ascending where the backend can, in int64 batches."""

    def count_keys(self, table: str) -> int:
        """How many keys ``table``'s live view holds (what sampled verify compares).

        The default counts :meth:`scan_keys`; backends override it with one count on the
        server. Stores with ``capabilities.scan``.
        """
        if not self.capabilities.scan:
            raise self._unsupported("counting a view's keys")
        return sum(len(batch) for batch in self.scan_keys(table))

    def scan_rows(
        self, table: str, batch_rows: int = 65536
    ) -> Iterator[tuple[np.ndarray, ReadResult]]:
        """Every row of a live view, in batches of ``(keys, rows)`` (what ``verify --all`` reads).

        The default reads the keys of :meth:`scan_keys` back with :meth:`read` (a key deleted
        in between comes back with ``found`` False); backends override it with one scan.
        """
        for keys in self.scan_keys(table, batch_rows):
            yield keys, self.read(table, keys)

    def delete(self, table: str, keys: np.ndarray, version: int) -> int:
        """Delete ``keys`` at ``version`` (a versioned delete; see the class contract)."""
        view = self.views()[table]
        n = int(np.asarray(keys).shape[0])
        width = codec.encoded_width(view.dtype, view.dim)
        return self.write(
            table,
            np.asarray(keys, np.int64),
            np.zeros((n, width), codec.element_type(view.dtype)),
            np.ones(n, np.int8),
            np.full(n, version, np.int64),
        )

    # ---- snapshots and staging (optional) ---------------------------------------------------
    def sweep_below(self, table: str, version: int) -> None:
        """Remove what ``table``'s live view holds below ``version``; idempotent.

        Rows and tombstones older than ``version`` go, and ``version`` becomes the view's floor
        (a late older write is then superseded). This is what completing a snapshot does to
        the rows; the rule of *when* lives in :func:`deltarec.publish.snapshot.finish_snapshot`.
        Stores with ``capabilities.snapshot_replace``.

        Raises:
            UnsupportedError: the backend cannot remove rows (names it).
        """
        raise self._unsupported("removing the keys a snapshot lacks")

    def write_parts(
        self,
        table: str,
        batches: Iterable[RowBatch],
        marks: Sequence[ProgressMark],
        staging_generation: int | None = None,
        before_commit: Callable[[], None] | None = None,
    ) -> int:
        """Several ranks' parts of one table, with every part's mark, in one transaction.

        Rows are applied in the order they come (a key in two parts as part after part would);
        ``before_commit`` runs last inside the transaction and what it raises rolls it back.
        Returns the rows applied. Stores with ``capabilities.parts_together``.

        Raises:
            UnsupportedError: the backend cannot (names it).
        """
        raise self._unsupported("several parts in one transaction (write_parts)")

    def merge_staging(self, run: str, generation: int) -> int:
        """Make ``generation``'s staging views live with the versioned-merge contract.

        Snapshots of the generation recorded as not yet swept (see :class:`Registry`) are swept
        with it. One transaction where ``capabilities.atomic_merge``; elsewhere idempotent and
        resumable. The staging views are dropped afterwards. Returns the rows merged. Stores
        with ``capabilities.staging``.

        Raises:
            UnsupportedError: the backend has no staging (names it).
        """
        raise self._unsupported("staging views (merge_staging)")

    def drop_staging(self, run: str, generation: int) -> int:
        """Drop ``generation``'s staging views unmerged (a staged generation that failed verify).

        Nothing of the generation reaches the live views; dropping again is a no-op.

        Returns:
            How many staging views were dropped.

        Raises:
            UnsupportedError: the backend has no staging (names it).
        """
        raise self._unsupported("staging views (drop_staging)")

    @property
    def registry(self) -> Registry:
        """The registry of this store's control plane.

        The store itself where it is a :class:`Registry` (the SQL stores, Redis), else the
        registry it was composed with.
        """
        if isinstance(self, Registry):
            return self
        raise self._unsupported("a registry")  # pragma: no cover - every backend has one

    # ---- lifecycle -----------------------------------------------------------------------
    @abc.abstractmethod
    def close(self) -> None:
        """Release connections and files (idempotent)."""

    def describe(self) -> str:
        """The store's URL without credentials (for messages and logs)."""
        return self.kind

    def identity(self) -> str:
        """What tells this store apart from every other; no credentials.

        Where its rows are, resolved (:meth:`place`), and the random id its registry keeps in
        itself (:meth:`Registry.store_uuid`): a copy of a store elsewhere has another place,
        and another store reached through the same URL (another file in another directory,
        a store made anew) has another id. Verification records are bound to it
        (:mod:`deltarec.verify.records`), never to the URL as typed.
        """
        return f"{self.place()}#{self.registry.store_uuid() or ''}"

    def place(self) -> str:
        """Where this store's rows are, as resolved as the backend can say (default: the URL)."""
        return self.describe()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _unsupported(self, what: str) -> UnsupportedError:
        return UnsupportedError(f"the {self.kind} store does not support {what}")

    def _writer(self, what: str) -> str:
        """The handle's run, for an operation that changes rows; raises if it has none."""
        if self.run is None:
            raise BadInputError(
                f"{what} in {self.describe()} needs a run: rows are kept per run, so open the "
                "store for one (open_store(url, run=...), or --run on the command line)"
            )
        return self.run

    def _check_run(self, run: str, what: str) -> None:
        """``run`` must be the handle's own (an operation on ``run``'s views)."""
        if self._writer(what) != run:
            raise BadInputError(
                f"{what} of run {run!r} through a store handle of run {self.run!r} "
                f"({self.describe()}): open the store for run {run!r}"
            )

    def _check_mark(self, mark: ProgressMark | None) -> None:
        """A progress mark must belong to the handle's run (its rows are that run's)."""
        run = self._writer("writing rows")
        if mark is not None and mark.run != run:
            raise BadInputError(
                f"a progress mark of run {mark.run!r} was written through a store handle of "
                f"run {run!r} ({self.describe()}): open the store for run {mark.run!r}"
            )


class Registry(abc.ABC):
    """The control plane of a store.

    Generations, progress marks, freshness, the serving pointer, and the bookkeeping of
    snapshots and staging. The SQL stores and Redis keep it next to the rows (they implement
    :class:`Store` and :class:`Registry`); a store with no place for it (FeatureStore) is
    composed with a registry elsewhere. :attr:`Store.registry` gives the registry of any store.
    """

    @abc.abstractmethod
    def register_generation(self, run: str, generation: int, origin: str | None = None) -> None:
        """Record that ``generation`` of ``run`` publishes to this store (idempotent).

        ``origin`` names the artifacts the generation is (its ``GENERATION.json``'s
        ``created_at``): the first origin registered for a generation is kept, and another is
        refused, so that the artifacts of another lineage under the same run name are never
        taken for the ones the store's marks count (:func:`origin_error`).

        Raises:
            BadInputError: ``origin`` is not the one registered for the generation.
        """

    @abc.abstractmethod
    def generations(self, run: str) -> list[int]:
        """The generations of ``run`` known to the store, ascending."""

    def generation_origin(self, run: str, generation: int) -> str | None:
        """The ``created_at`` of the artifacts ``generation`` was registered from, or None."""
        return None

    def check_writer(self, run: str, generation: int) -> None:
        """The publish fence: raise unless ``generation`` is the newest of ``run`` seen here.

        Backends with ``atomic_marks`` also check it inside every write that carries a mark,
        in the rows' transaction, so a writer superseded mid-dump commits nothing more.

        Raises:
            StaleGenerationError: a newer generation of ``run`` is registered.
        """
        known = self.generations(run)
        if known and known[-1] > generation:
            raise StaleGenerationError(self.describe_registry(), run, generation, known[-1])

    def describe_registry(self) -> str:
        """The registry's place, for messages (no credentials)."""
        describe = getattr(self, "describe", None)
        return str(describe()) if callable(describe) else type(self).__name__

    @abc.abstractmethod
    def record_progress(self, mark: ProgressMark) -> None:
        """Record ``mark`` on its own.

        A store whose rows live elsewhere writes it right after them; a store with
        ``atomic_marks`` commits it with its rows in ``write`` instead.
        """

    def record_progress_many(self, marks: Sequence[ProgressMark]) -> None:
        """Record several marks on their own, together where the store can (one transaction).

        The default records them one by one, in order.
        """
        for mark in marks:
            self.record_progress(mark)

    @abc.abstractmethod
    def progress(self, run: str, generation: int) -> list[ProgressMark]:
        """Every progress mark of one generation (latest per dump, table and rank)."""

    @abc.abstractmethod
    def record_freshness(self, record: FreshnessRecord) -> None:
        """Store when a dump was committed and when it became visible (idempotent per rank)."""

    @abc.abstractmethod
    def freshness(self, run: str, generation: int | None = None) -> list[FreshnessRecord]:
        """Freshness records of ``run`` (one generation, or all), by generation, seq, rank."""

    @abc.abstractmethod
    def set_serving(self, run: str, generation: int, seq: int, note: str = "") -> ServingPointer:
        """Point serving at ``generation`` through dump ``seq`` of ``run``; kept in a history.

        Where the store keeps serving names, the serving name of every table ``run`` has a live
        view of reads ``run``'s rows from then on, switched in the same transaction.
        """

    def get_serving(self, run: str) -> ServingPointer | None:
        """The current serving pointer of ``run``, or None if never promoted.

        The default takes the newest of :meth:`serving_history`.
        """
        history = self.serving_history(run)
        return history[-1] if history else None

    @abc.abstractmethod
    def serving_history(self, run: str) -> list[ServingPointer]:
        """Every serving pointer of ``run``, oldest first."""

    def serving_runs(self) -> dict[str, str]:
        """Table id -> the run whose rows that table's serving name reads.

        A table gets its first run when that run provisions it; :meth:`set_serving` of another
        run moves it. The default (a registry whose store keeps no serving names) has none.
        """
        return {}

    def store_uuid(self) -> str | None:
        """The random id this store keeps in itself, or None where the registry keeps none.

        Written once, by the first handle that opens the store (the SQL stores:
        ``deltarec_store_id``; Redis: ``<prefix>~store``), and never changed; see
        :meth:`Store.identity`.
        """
        return None

    @abc.abstractmethod
    def snapshot(self, run: str, generation: int, seq: int, table: str) -> SnapshotRecord | None:
        """The record of a completed snapshot dump of ``table``, or None if not completed."""

    @abc.abstractmethod
    def record_snapshot(self, record: SnapshotRecord) -> None:
        """Record a completed snapshot (replacing the record of the same dump and table)."""


def origin_error(where: str, run: str, generation: int, held: str, origin: str) -> BadInputError:
    """The refusal of artifacts not the generation's registered ones (``register_generation``)."""
    return BadInputError(
        f"{where}: run {run!r} generation {generation} was published here from artifacts "
        f"created at {held}, not from these (created at {origin}): a run name is one lineage "
        "of artifacts, and the store's progress marks count the first one's dumps. Use "
        "these artifacts under another run name (--run), or with another store"
    )


__all__ = [
    "Capabilities",
    "FreshnessRecord",
    "ProgressMark",
    "ReadResult",
    "Registry",
    "ServingPointer",
    "SnapshotRecord",
    "Store",
    "ViewInfo",
]


def first_batch(table: str, batches: Iterable[RowBatch]) -> tuple[RowBatch, Iterator[RowBatch]]:
    """The first of ``batches`` and an iterator over the rest (``write_batches`` needs one)."""
    it = iter(batches)
    batch = next(it, None)
    if batch is None:
        raise ValueError(f"write_batches of {table!r} got no batch")
    return batch, it
