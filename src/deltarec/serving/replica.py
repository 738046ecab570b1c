"""The replica: a run's tables and dense state at one point, in memory, switched atomically.

A :class:`Replica` serves one :class:`Snapshot` at a time: every table's
:class:`~deltarec.serving.table.TableState` and the dense state of one point ``(generation,
seq)``. Readers pin the snapshot they read (:meth:`Replica.pinned`), so a lookup sees all of a
dump or none of it. The writer (one thread, :class:`~deltarec.serving.follow.Follower`) keeps
up to three series of snapshots, each a :class:`Line` of one generation:

* the **current** line, served, which may follow its generation's newer dumps;
* a **shadow** line: a newer generation applied beside it, made current by :meth:`install`
  when that generation is promoted;
* the **previous** line: the one a swap replaced, kept so a rollback swaps straight back.

A line only takes the dump that comes next in its generation (:meth:`Line.check`): a gap, a
duplicate or an older dump raises a :class:`~deltarec.serving.types.SequenceError` naming it.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from deltarec.artifacts.base import BaseInfo
from deltarec.artifacts.dense import DenseInfo, read_dense
from deltarec.artifacts.lineage import expected_state
from deltarec.artifacts.root import ArtifactRoot
from deltarec.artifacts.shards import ShardRows, iter_shard
from deltarec.artifacts.types import DumpKind, Manifest, TableSpec, parse_time
from deltarec.errors import BadInputError
from deltarec.serving.table import Staged, TableState, TableWriter, decode_rows
from deltarec.serving.types import (
    DuplicateDumpError,
    GapError,
    NotReadyError,
    OutOfOrderError,
    Position,
    UnknownTableError,
)

LOAD_CHUNK = 1 << 20
"""Keys per chunk when a table is loaded from the artifacts' expected state."""
VISIBLE_KEPT = 1000
"""Dumps whose visibility the replica remembers (freshness records, metrics)."""


@dataclass(frozen=True)
class Visible:
    """A dump that became visible in the served snapshot.

    Attributes:
        generation, seq: the dump.
        taken_at: unix time it was taken on the training side (None if unknown).
        visible_at: unix time lookups started to see it.
    """

    generation: int
    seq: int
    taken_at: float | None
    visible_at: float

    @property
    def freshness_s(self) -> float | None:
        """Seconds from the training step to visible here."""
        return None if self.taken_at is None else self.visible_at - self.taken_at


def manifest_digest(manifest: Manifest) -> str:
    """sha256 of a manifest's JSON (what identifies an applied dump across restarts)."""
    return hashlib.sha256(json.dumps(manifest.to_json(), sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class DenseState:
    """The dense state a snapshot serves.

    Attributes:
        info: the manifest field it was read from.
        generation, seq: the dump that carried it.
        tensors: parameter and buffer name -> tensor (on the replica's device).
    """

    info: DenseInfo
    generation: int
    seq: int
    tensors: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Snapshot:
    """What a replica serves at one point: every table and the dense state, never changed.

    Attributes:
        position: the point (run, generation, seq).
        tables: table id -> state.
        dense: the dense state of the point (None if no dump of the lineage carried one).
        epoch: the replica's publication counter when it was built.
        digest: :func:`manifest_digest` of the last dump applied ("" if loaded whole).
        taken_at: unix time the last dump was taken on the training side (None if unknown).
        applied_at: unix time it became visible here.
    """

    position: Position
    tables: dict[str, TableState]
    dense: DenseState | None
    epoch: int
    digest: str = ""
    taken_at: float | None = None
    applied_at: float = field(default_factory=time.time)

    def table(self, table: str) -> TableState:
        """One table's state; raises :class:`UnknownTableError` naming the tables held."""
        try:
            return self.tables[table]
        except KeyError:
            raise UnknownTableError(table, sorted(self.tables)) from None


def load_dense(root: ArtifactRoot, manifest: Manifest, device: torch.device) -> DenseState | None:
    """The dense state a committed dump carries (checked against its sha256), or None."""
    found = read_dense(root, manifest)
    if found is None:
        return None
    info, data = found
    tensors = torch.load(io.BytesIO(data), map_location=device, weights_only=True)
    return DenseState(info, manifest.generation, manifest.seq, dict(tensors))


def taken_at(manifest: Manifest) -> float | None:
    """When a dump was taken on the training side (``taken_at``, else ``created_at``), unix s."""
    text = manifest.extra.get("taken_at") or manifest.created_at
    try:
        return parse_time(str(text)) if text else None
    except ValueError:
        return None


def _check_contiguous(run: str, manifests: list[Manifest], base: BaseInfo | None = None) -> None:
    """Every generation's dumps in ``manifests`` follow each other from 0 or 1, or raise.

    Of a generation the replay's ``base`` folds, from the dump after the newest it folds.
    """
    seqs: dict[int, list[int]] = {}
    for m in manifests:
        seqs.setdefault(m.generation, []).append(m.seq)
    for generation, found in seqs.items():
        folded = base.covers(generation) if base is not None else -1
        start = folded + 1 if folded >= 0 else (0 if found[0] == 0 else 1)
        for want, got in zip(range(start, start + len(found)), found, strict=True):
            if want != got:
                raise GapError(
                    run, generation, want - 1, got, f"dump {want} is missing from the outbox"
                )


class Line:
    """One generation's series of snapshots (one writer).

    Args:
        root: the artifact root.
        position: the point its writers hold.
        writers: table id -> writer.
        dense: the dense state at the point.
        digest: the digest of the last dump applied.
        device: where its rows live.
    """

    def __init__(
        self,
        root: ArtifactRoot,
        position: Position,
        writers: dict[str, TableWriter],
        dense: DenseState | None,
        digest: str,
        device: torch.device,
    ) -> None:
        self.root = root
        self.position = position
        self.writers = writers
        self.dense = dense
        self.digest = digest
        self.device = device
        self._specs: dict[str, TableSpec] | None = None

    @classmethod
    def load(
        cls, root: ArtifactRoot, run: str, generation: int, seq: int, device: torch.device
    ) -> Line:
        """A line at ``generation`` through dump ``seq``, from the artifacts' expected state.

        Every present key's row is read from the shards that last wrote it (the lineage's
        replay, :func:`~deltarec.artifacts.lineage.expected_state`); the dense state is the
        newest one a dump of the lineage carries.

        Raises:
            GapError: a generation of the lineage misses a committed dump before the point.
        """
        state = expected_state(root, run, generation, seq)
        _check_contiguous(run, state.manifests, state.base)
        writers = {}
        for table, et in state.tables.items():
            present = et.present
            keys = et.keys[present]
            versions = et.versions[present]
            parts = [et.load(keys[i : i + LOAD_CHUNK]) for i in range(0, len(keys), LOAD_CHUNK)]
            rows = np.concatenate(parts) if parts else et.load(keys)
            writers[table] = TableWriter.from_rows(table, et.spec, device, keys, rows, versions)
        dense = None
        for m in reversed(state.manifests):
            dense = load_dense(root, m, device)
            if dense is not None:
                break
        last = state.manifests[-1] if state.manifests else None
        digest = manifest_digest(last) if last is not None and last.seq == seq else ""
        return cls(root, Position(run, generation, seq), writers, dense, digest, device)

    def snapshot(self, epoch: int, taken_at: float | None = None) -> Snapshot:
        """The line's point as a snapshot."""
        tables = {t: w.state for t, w in self.writers.items()}
        return Snapshot(self.position, tables, self.dense, epoch, self.digest, taken_at)

    def check(self, manifest: Manifest, digest: str | None = None) -> None:
        """Raise unless ``manifest`` is the dump that comes next in this line.

        Raises:
            DuplicateDumpError: it is the dump applied last (same or different content).
            OutOfOrderError: another run or generation, or older than the position.
            GapError: it skips one or more dumps (names the first missing one).
        """
        p = self.position
        if manifest.run != p.run or manifest.generation != p.generation:
            raise OutOfOrderError(
                p.run,
                p.generation,
                p.seq,
                manifest.seq,
                f"the dump is of run {manifest.run!r} generation {manifest.generation}",
            )
        if manifest.seq == p.seq:
            same = (digest or manifest_digest(manifest)) == self.digest
            raise DuplicateDumpError(
                p.run,
                p.generation,
                p.seq,
                manifest.seq,
                "already applied" if same else "a different dump under the seq already applied",
            )
        if manifest.seq < p.seq:
            raise OutOfOrderError(
                p.run, p.generation, p.seq, manifest.seq, "older than the dump applied"
            )
        if manifest.seq > p.seq + 1:
            raise GapError(
                p.run,
                p.generation,
                p.seq,
                manifest.seq,
                f"dump {p.seq + 1} is missing: it is not committed in the outbox",
            )

    def stage(self, manifest: Manifest, epoch: int) -> tuple[dict[str, Staged], DenseState | None]:
        """Every table's next state with ``manifest``'s rows (checked first; not committed)."""
        self.check(manifest)
        specs = self._table_specs()
        dump_dir = self.root.dump_dir(manifest.run, manifest.generation, manifest.seq)
        replace = manifest.kind is DumpKind.SNAPSHOT
        staged: dict[str, Staged] = {}
        for table in manifest.tables:
            spec = specs[table]
            parts = [
                rows
                for shard in manifest.shards_of(table)
                for rows in iter_shard(self.root, dump_dir, shard, spec.dtype, batch_rows=1 << 20)
            ]
            rows = ShardRows.concat(parts) if parts else ShardRows.empty(spec.dtype, spec.dim)
            writer = self.writers.get(table)
            if writer is None:
                writer = self.writers[table] = TableWriter(table, spec, self.device)
            staged[table] = writer.stage(
                rows.keys, rows.embedding, rows.ops, manifest.version, epoch, replace=replace
            )
        dense = load_dense(self.root, manifest, self.device)
        return staged, dense if dense is not None else self.dense

    def commit(
        self, manifest: Manifest, staged: dict[str, Staged], dense: DenseState | None
    ) -> None:
        """The staged tables are the line's point now."""
        for table, s in staged.items():
            self.writers[table].commit(s)
        self.dense = dense
        self.position = Position(self.position.run, manifest.generation, manifest.seq)
        self.digest = manifest_digest(manifest)

    def reclaim(self, oldest_pinned: int | None) -> None:
        """Free the slots no pinned reader can still read (see :meth:`TableWriter.reclaim`)."""
        for w in self.writers.values():
            w.reclaim(oldest_pinned)

    def _table_specs(self) -> dict[str, TableSpec]:
        if self._specs is None:
            p = self.position
            specs: dict[str, TableSpec] = {}
            for info in self.root.lineage(p.run, p.generation):
                specs.update(info.tables)
            self._specs = specs
        return self._specs


class Replica:
    """A run's tables and dense state in memory, served one snapshot at a time.

    Reads may come from any thread; writes (load, apply, swap) from one thread.

    Args:
        root: the artifact root (an :class:`ArtifactRoot` or its URI).
        run: the run served.
        device: where the tables live (``cpu``, ``cuda``, ``cuda:1``).
    """

    def __init__(self, root: ArtifactRoot | str, run: str, device: str | torch.device = "cpu"):
        self.root = root if isinstance(root, ArtifactRoot) else ArtifactRoot(root)
        self.run = run
        try:
            self.device = torch.device(device)
        except RuntimeError as e:
            raise BadInputError(f"device {device!r}: {e}") from e
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise BadInputError(f"device {device!r}: torch sees no CUDA device")
        self._lock = threading.Lock()
        self._current: Snapshot | None = None
        self._pins: dict[int, int] = {}
        self._epoch = 0
        self.line: Line | None = None
        """The current line (writer side)."""
        self.shadow: Line | None = None
        """A newer generation applied beside the current one, waiting for promote."""
        self.previous: Line | None = None
        """The line the last swap replaced (a rollback swaps back to it)."""
        self.applied_dumps = 0
        """Dumps applied to any line since the replica was made."""
        self.applied_rows = 0
        """Rows (upserts and deletes) of those dumps."""
        self.apply_seconds = 0.0
        """Seconds spent applying them (reading shards included)."""
        self.visible: collections.deque[Visible] = collections.deque(maxlen=VISIBLE_KEPT)
        """The latest dumps that became visible here (served), oldest first."""

    # ---- reading -------------------------------------------------------------------------
    @property
    def current(self) -> Snapshot | None:
        """The snapshot served now (None before the first load)."""
        return self._current

    @contextlib.contextmanager
    def pinned(self) -> Iterator[Snapshot]:
        """The snapshot served now, held for the block: its rows are not reused meanwhile.

        Raises:
            NotReadyError: the replica holds no generation yet.
        """
        with self._lock:
            snap = self._current
            if snap is None:
                raise NotReadyError(f"the replica of run {self.run!r} holds no generation yet")
            self._pins[snap.epoch] = self._pins.get(snap.epoch, 0) + 1
        try:
            yield snap
        finally:
            with self._lock:
                left = self._pins[snap.epoch] - 1
                if left:
                    self._pins[snap.epoch] = left
                else:
                    del self._pins[snap.epoch]

    def lookup(
        self, table: str, ids: torch.Tensor | np.ndarray, decode: bool = True
    ) -> torch.Tensor:
        """Rows of ``ids`` in ``table`` from one snapshot.

        Float32 ``[n, dim]`` with ``decode``, else encoded as stored. A ZCH table answers an
        id it does not hold with key ``-1``'s row; a plain table with zeros.
        """
        ids_t = torch.as_tensor(np.asarray(ids) if isinstance(ids, np.ndarray) else ids)
        with self.pinned() as snap:
            state = snap.table(table)
            rows, _ = state.lookup(ids_t)
            return decode_rows(rows, state.spec) if decode else rows

    def read(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Exact readback ``(found, versions, encoded rows)`` of ``keys`` (see TableState.read)."""
        with self.pinned() as snap:
            return snap.table(table).read(keys)

    # ---- writing -------------------------------------------------------------------------
    def load(self, generation: int, seq: int) -> Line:
        """Build a line at ``generation`` through ``seq`` from the artifacts (not served yet)."""
        return Line.load(self.root, self.run, generation, seq, self.device)

    def install(self, line: Line, taken_at: float | None = None) -> Snapshot:
        """Serve ``line``'s point now (the line served before becomes :attr:`previous`)."""
        if self.shadow is line:
            self.shadow = None
        if self.line is not None and self.line is not line:
            self.previous = self.line
        self.line = line
        return self._publish(line, taken_at)

    def apply(self, manifest: Manifest, line: Line | None = None) -> Snapshot | None:
        """Apply the next committed dump to ``line`` (default: the current line), atomically.

        Every table of the dump is staged first (rows into free slots, new indexes beside the
        old ones); then, for the current line, one reference swap publishes all of them and
        the dense state together. Returns the snapshot published (None for another line).

        Raises:
            SequenceError: the dump does not come next (gap, duplicate, out of order).
            ArtifactError: a shard or the dense state is missing or corrupted (nothing applied).
        """
        line = line or self.line
        if line is None:
            raise NotReadyError(f"the replica of run {self.run!r} holds no generation yet")
        t0 = time.perf_counter()
        staged, dense = line.stage(manifest, self._epoch + 1)
        line.commit(manifest, staged, dense)
        self.applied_dumps += 1
        self.applied_rows += sum(manifest.tables.values())
        snap = None
        if line is self.line:
            snap = self._publish(line, taken_at(manifest), visible=True)
        self.apply_seconds += time.perf_counter() - t0
        return snap

    def swap_back(self) -> Snapshot | None:
        """Serve the previous line again (a rollback); None if there is none."""
        if self.previous is None:
            return None
        return self.install(self.previous)

    def _publish(self, line: Line, taken_at: float | None, visible: bool = False) -> Snapshot:
        with self._lock:
            self._epoch += 1
            snap = line.snapshot(self._epoch, taken_at)
            if visible:  # recorded before anyone can see the snapshot
                p = snap.position
                self.visible.append(Visible(p.generation, p.seq, taken_at, snap.applied_at))
            self._current = snap
            oldest = min(self._pins) if self._pins else None
        for each in {id(x): x for x in (self.line, self.shadow, self.previous) if x}.values():
            each.reclaim(oldest)
        return snap


__all__ = [
    "DenseState",
    "Line",
    "Replica",
    "Snapshot",
    "Visible",
    "load_dense",
    "manifest_digest",
    "taken_at",
]
