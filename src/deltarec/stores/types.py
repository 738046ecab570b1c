"""Records the store interface passes around: read results, progress marks, serving pointers.

All times are unix seconds (float, UTC). All arrays are numpy arrays; embeddings are always the
encoded rows of :mod:`deltarec.artifacts.codec` (``[n, encoded_width]`` of the table's element
type), identical to the parquet ``embedding`` column, so nothing is re-encoded on the way.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from deltarec.artifacts import codec
from deltarec.artifacts.types import DType
from deltarec.ids import make_version


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do.

    Optional operations raise :class:`~deltarec.errors.UnsupportedError` (a
    ``NotImplementedError``) naming what is missing. What a backend does not declare it cannot
    do (the operations default to False).
    """

    deletes: bool = False
    """``op = 1`` deletes the key (with a version-guarded tombstone); else the row is written."""
    atomic_marks: bool = False
    """A progress mark commits in the same transaction as its rows (exactly-once)."""
    atomic_merge: bool = False
    """``merge_staging`` makes a whole generation live in one transaction."""
    staging: bool = False
    """Per-generation staging views (``staged`` publish mode) are supported."""
    scan: bool = False
    """``scan_keys`` lists every key of a view."""
    snapshot_replace: bool = False
    """Publishing a snapshot removes the keys it lacks (older versions): ``sweep_below``."""
    fallback_key: bool = True
    """Key ``-1`` of a ZCH table holds its fallback row. Without (TorchEasyRec's contract, where
    ``-1`` is the invalid-key sentinel) key ``-1`` is not written, and verify does not ask for
    it."""
    versions: bool = True
    """Each row keeps its version, and ``read`` returns it; else versions read back as 0 and a
    row can only be checked by its values."""
    writes_block_reads: bool = False
    """While the server applies one write (a transaction, a script) no read is served: Redis
    runs one command or ``MULTI``/``EXEC`` at a time. A read-latency budget then bounds how long
    the server runs any one part of a write (:mod:`deltarec.publish.budget`; Redis writes a
    batch as a pipeline of small units then, :mod:`deltarec.stores.redis.paced`)."""
    whole_writes: bool = False
    """A write (one ``write``/``write_batches`` call) applies whole or not at all, and a bad row
    aborts it: the publisher may then check a table's rows while writing them instead of reading
    them twice (the SQL stores)."""
    parts_together: bool = False
    """``write_parts`` writes several ranks' parts of one table, with every part's mark, in one
    transaction (SQLite: one key-ordered pass instead of part after part)."""
    batch_bytes: int = 8 << 20
    """The preferred encoded bytes per write transaction (and progress mark): the publisher's
    default. The SQL stores take a large transaction sorted by key in one pass, several times
    faster than many small ones in random key order (SQLite, 1M rows of dim 64 in random order
    on a 2-core VM: 16 MB transactions 65-138k rows/s, one transaction 360-460k)."""


@dataclass(frozen=True)
class ViewInfo:
    """One provisioned view: a table's live view, or its staging view of one generation."""

    table: str
    name: str
    dim: int
    dtype: DType
    staging_generation: int = 0  # 0 = the live view
    floor_version: int = 0  # writes below this version are superseded (snapshot replace)
    run: str | None = None  # the run whose rows the view holds (docs/runs.md)

    def describe(self) -> str:
        """``dim=64 dtype=float32`` (for mismatch messages)."""
        return f"dim={self.dim} dtype={DType(self.dtype).value}"


@dataclass
class ReadResult:
    """Rows read for ``n`` requested keys, in the order requested.

    Attributes:
        found: bool ``[n]``; False where the store holds no live row (absent or tombstoned).
        versions: int64 ``[n]``; the stored version, 0 where not found.
        embedding: ``[n, encoded_width]`` encoded rows; zeros where not found.
    """

    found: np.ndarray
    versions: np.ndarray
    embedding: np.ndarray

    @classmethod
    def none_found(cls, view: ViewInfo, n: int) -> ReadResult:
        """``n`` rows of ``view``, none found yet (what a backend's ``read`` fills in)."""
        return cls(
            np.zeros(n, bool),
            np.zeros(n, np.int64),
            np.zeros(
                (n, codec.encoded_width(view.dtype, view.dim)), codec.element_type(view.dtype)
            ),
        )

    def __len__(self) -> int:
        return int(self.found.shape[0])


class RowBatch(NamedTuple):
    """One batch of rows to write: the arguments of :meth:`~deltarec.stores.Store.write`."""

    keys: np.ndarray  # int64 [n]
    embedding: np.ndarray  # [n, encoded_width] encoded rows
    ops: np.ndarray  # int8 [n]; 0 upsert, 1 delete
    versions: np.ndarray  # int64 [n]


@dataclass(frozen=True)
class ProgressMark:
    """How far one rank's shard of one table of one dump has been applied.

    A shard is written in byte-sized transactions; each carries a mark with the number of the
    shard's rows applied so far, and the last one ``complete=True``. Marks are committed in the
    same transaction as their rows where ``Capabilities.atomic_marks`` holds.
    """

    run: str
    generation: int
    seq: int
    table: str
    rank: int
    rows: int
    complete: bool
    staging_generation: int = 0
    written_at: float = 0.0  # filled in by the store when read back

    @property
    def version(self) -> int:
        """The dump's version, ``generation << 32 | seq``."""
        return make_version(self.generation, self.seq)


class Write(NamedTuple):
    """One write call as a backend applies it: what :meth:`~deltarec.stores.Store.apply` gets.

    ``batches`` is consumed once, in order, and holds at least one batch (it may be empty);
    keys are unique within the whole call. ``mark`` is committed with the rows;
    ``staging_generation``, if set, writes into that generation's staging view.
    """

    table: str
    batches: Iterable[RowBatch]
    mark: ProgressMark | None = None
    staging_generation: int | None = None


@dataclass(frozen=True)
class SnapshotRecord:
    """A snapshot dump of one table whose every rank's part is in.

    See :func:`deltarec.publish.snapshot.finish_snapshot`. ``swept_at`` is when the keys it
    lacks were removed from the live view; None while a staged snapshot waits for
    ``merge_staging``.
    """

    run: str
    generation: int
    seq: int
    table: str
    staging_generation: int
    version: int
    swept_at: float | None


@dataclass(frozen=True)
class ServingPointer:
    """The generation (through dump ``seq``) that serving was last promoted to."""

    run: str
    generation: int
    seq: int
    promoted_at: float
    note: str = ""

    @property
    def version(self) -> int:
        """``generation << 32 | seq``."""
        return make_version(self.generation, self.seq)


@dataclass(frozen=True)
class FreshnessRecord:
    """When one rank's part of a dump was taken and when it became visible in the store.

    ``committed_at`` is the moment the dump was taken on the training side (MANIFEST.json's
    ``taken_at``: freshness counts from the training step), or the manifest's commit for
    dumps written without ``taken_at``.
    """

    run: str
    generation: int
    seq: int
    rank: int
    committed_at: float
    visible_at: float

    @property
    def lag_s(self) -> float:
        """Seconds from the dump being taken (or committed) to visibility."""
        return self.visible_at - self.committed_at
