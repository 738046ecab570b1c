"""Replay of committed dumps across a generation's lineage.

Two questions are answered from artifacts alone (no store, no torch):

* :func:`expected_state`: what serving must hold for a generation up to a dump: the latest row
  per key over the lineage, where an ancestor contributes only rows read at or before the
  checkpoint step its child restored from, snapshots replace their table, and ``op == 1``
  means absent.
* :func:`keys_published_after`: which keys a restored generation must republish so serving
  never stays ahead of the model: every key that any dump published outside the restored
  lineage's past.

Only the ``key``, ``op`` and ``step`` columns are read to resolve the latest row per key;
embeddings are read on demand by :meth:`ExpectedTable.load`.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from deltarec.artifacts import codec
from deltarec.artifacts.root import ArtifactRoot
from deltarec.artifacts.types import DType, DumpKind, Manifest, Op, Parent, ShardInfo, TableSpec
from deltarec.errors import ArtifactError, BadInputError


@dataclass(frozen=True)
class ShardRef:
    """Where a shard lies: its dump directory and manifest entry."""

    dump_dir: str
    shard: ShardInfo
    version: int


def _read_columns(root: ArtifactRoot, ref: ShardRef, columns: list[str]) -> dict[str, np.ndarray]:
    path = posixpath.join(ref.dump_dir, ref.shard.path)
    try:
        if root.is_local:  # Arrow's own memory-mapped reader: no Python file in the loop
            table = pq.read_table(path, columns=columns, memory_map=True)
        else:
            with root.fs.open(path, "rb") as f:
                table = pq.read_table(f, columns=columns)
    except FileNotFoundError:
        raise ArtifactError(root.url(path), "shard listed in the manifest is missing") from None
    except OSError as e:
        raise ArtifactError(root.url(path), f"unreadable parquet: {e}") from e
    if table.num_rows != ref.shard.rows:
        raise ArtifactError(
            root.url(path), f"holds {table.num_rows} rows, the manifest says {ref.shard.rows}"
        )
    return {c: table.column(c) for c in columns}


def _one_run(idx: np.ndarray) -> bool:
    """True if ``idx`` is ``a, a+1, ..., b`` (non-empty)."""
    return (
        len(idx) > 0
        and int(idx[-1]) - int(idx[0]) + 1 == len(idx)
        and bool((np.diff(idx) == 1).all())
    )


def _copy_run(column: Any, first: int, dst: np.ndarray, dtype: DType) -> None:
    """Copy rows ``first .. first + len(dst)`` of an embedding column into ``dst``."""
    chunks = getattr(column, "chunks", [column])
    offset, end = 0, first + len(dst)
    for chunk in chunks:
        lo, hi = max(first, offset), min(end, offset + len(chunk))
        if lo < hi:
            values = codec.embedding_matrix(chunk.slice(lo - offset, hi - lo), dtype)
            dst[lo - first : hi - first] = values
        offset += len(chunk)


@dataclass
class ExpectedTable:
    """The expected state of one table: the latest record of every key ever seen.

    Attributes:
        table: table id.
        spec: the table's spec (from the newest generation of the lineage).
        keys: int64, sorted, unique: every key with a record (present or absent).
        versions: int64 version of each key's latest record.
        ops: int8: ``Op.UPSERT`` (present) or ``Op.EVICTED`` (absent: evicted, or removed by
            a later snapshot).
        steps: int64 training step the latest record was read at.
    """

    table: str
    spec: TableSpec
    keys: np.ndarray
    versions: np.ndarray
    ops: np.ndarray
    steps: np.ndarray
    _refs: list[ShardRef] = field(repr=False, default_factory=list)
    _ref_idx: np.ndarray = field(repr=False, default_factory=lambda: np.empty(0, np.int32))
    _row_idx: np.ndarray = field(repr=False, default_factory=lambda: np.empty(0, np.int64))
    _root: ArtifactRoot | None = field(repr=False, default=None)

    @property
    def present(self) -> np.ndarray:
        """Boolean mask of keys that serving must hold."""
        return self.ops == Op.UPSERT

    def present_keys(self) -> np.ndarray:
        """Sorted keys that serving must hold."""
        return self.keys[self.present]

    def index_of(self, keys: np.ndarray) -> np.ndarray:
        """Positions of ``keys`` in :attr:`keys`, ``-1`` where a key has no record."""
        keys = np.asarray(keys, dtype=np.int64)
        pos = np.searchsorted(self.keys, keys)
        pos = np.minimum(pos, max(len(self.keys) - 1, 0))
        hit = (len(self.keys) > 0) & (self.keys[pos] == keys) if len(self.keys) else None
        if hit is None:
            return np.full(keys.shape, -1, dtype=np.int64)
        return np.where(hit, pos, -1)

    def load(self, keys: np.ndarray) -> np.ndarray:
        """Encoded rows ``[n, encoded_width]`` of the latest records of ``keys``.

        For an absent key (``op == 1``) the row is the one its record carries (the fallback
        row of an evicted ZCH id; zeros for a key removed by a snapshot).

        Raises:
            KeyError: if a key has no record.
        """
        idx = self.index_of(keys)
        if (idx < 0).any():
            missing = np.asarray(keys)[idx < 0][:5].tolist()
            raise KeyError(f"table {self.table!r}: no expected record for keys {missing}")
        width = codec.encoded_width(self.spec.dtype, self.spec.dim)
        out = np.zeros((len(idx), width), dtype=codec.element_type(self.spec.dtype))
        ref_idx = self._ref_idx[idx]
        row_idx = self._row_idx[idx]
        assert self._root is not None or len(idx) == 0
        for r in np.unique(ref_idx[ref_idx >= 0]):
            sel = np.nonzero(ref_idx == r)[0]
            ref = self._refs[int(r)]
            col = _read_columns(self._root, ref, [codec.EMBEDDING])  # type: ignore[arg-type]
            rows = row_idx[sel]
            if _one_run(sel) and _one_run(rows):
                # A whole snapshot shard (or any run of consecutive rows): block copies chunk
                # by chunk, instead of combining the chunks, a gather and a scatter.
                dst = out[sel[0] : sel[-1] + 1]
                _copy_run(col[codec.EMBEDDING], int(rows[0]), dst, self.spec.dtype)
            else:
                out[sel] = codec.embedding_matrix(col[codec.EMBEDDING], self.spec.dtype)[rows]
        return out


@dataclass
class ExpectedState:
    """The expected serving state of a generation through a dump."""

    run: str
    generation: int
    through_seq: int | None
    version: int  # version of the newest dump included (0 if none)
    tables: dict[str, ExpectedTable]
    manifests: list[Manifest]  # every dump included, in version order

    def shard_refs(self) -> list[ShardRef]:
        """Every shard of every included dump (for checksum verification)."""
        return [
            ShardRef(dump_dir, s, m.version) for m, dump_dir in self._dump_dirs() for s in m.shards
        ]

    def _dump_dirs(self) -> list[tuple[Manifest, str]]:
        root = next((t._root for t in self.tables.values() if t._root is not None), None)
        if root is None:
            return []
        return [(m, root.dump_dir(m.run, m.generation, m.seq)) for m in self.manifests]


class _Accumulator:
    """Collects (key, version, op, step, shard, row) records of one table."""

    def __init__(self) -> None:
        self.parts: list[tuple[np.ndarray, ...]] = []
        self.snapshot_version = -1

    def add(self, ref_no: int, version: int, cols: dict[str, np.ndarray], keep: np.ndarray) -> None:
        keys = np.asarray(cols[codec.KEY], dtype=np.int64)
        rows = np.arange(len(keys), dtype=np.int64)
        if not keep.all():
            keys, rows = keys[keep], rows[keep]
        n = len(keys)
        self.parts.append(
            (
                keys,
                np.full(n, version, np.int64),
                np.asarray(cols[codec.OP], dtype=np.int8)[keep],
                np.asarray(cols[codec.STEP], dtype=np.int64)[keep],
                np.full(n, ref_no, np.int32),
                rows,
            )
        )

    def resolve(self) -> tuple[np.ndarray, ...]:
        if not self.parts:
            e64 = np.empty(0, np.int64)
            return e64, e64, np.empty(0, np.int8), e64, np.empty(0, np.int32), e64
        keys, versions, ops, steps, refs, rows = (
            np.concatenate(c) for c in zip(*self.parts, strict=True)
        )
        order = np.lexsort((versions, keys))
        keys = keys[order]
        last = np.ones(len(keys), dtype=bool)
        last[:-1] = keys[1:] != keys[:-1]
        pick = order[last]
        out = [keys[last], versions[pick], ops[pick].copy(), steps[pick], refs[pick], rows[pick]]
        if self.snapshot_version >= 0:
            removed = out[1] < self.snapshot_version
            out[2][removed] = Op.EVICTED
            out[4][removed] = -1  # no row to load: removed by the snapshot
        return tuple(out)


def _cutoffs(root: ArtifactRoot, run: str, generation: int) -> list[tuple[int, int | None]]:
    """``(generation, max step or None)`` for each generation of the lineage, oldest first."""
    chain = root.lineage(run, generation)
    out: list[tuple[int, int | None]] = []
    for i, info in enumerate(chain):
        child = chain[i + 1] if i + 1 < len(chain) else None
        out.append(
            (info.generation, child.parent.checkpoint_step if child and child.parent else None)
        )
    return out


def expected_state(
    root: ArtifactRoot, run: str, generation: int, through_seq: int | None = None
) -> ExpectedState:
    """The expected serving state of ``generation`` through dump ``through_seq`` (all if None).

    Raises:
        BadInputError: if ``through_seq`` names no committed dump of the generation.
        ArtifactError: if an artifact is missing, malformed or of an unknown schema version.
    """
    if through_seq is not None and through_seq not in root.list_dumps(run, generation):
        raise BadInputError(
            f"run {run!r} generation {generation} has no committed dump {through_seq} under "
            f"{root.uri} (committed: {root.list_dumps(run, generation)})"
        )
    specs = dict(root.read_generation(run, generation).tables)
    accs: dict[str, _Accumulator] = {}
    refs: list[ShardRef] = []
    manifests: list[Manifest] = []
    for gen, cutoff in _cutoffs(root, run, generation):
        for seq in root.list_dumps(run, gen):
            if gen == generation and through_seq is not None and seq > through_seq:
                break
            m = root.read_manifest(run, gen, seq)
            if cutoff is not None and m.first_step > cutoff:
                break
            manifests.append(m)
            dump_dir = root.dump_dir(run, gen, seq)
            for table in m.tables:
                acc = accs.setdefault(table, _Accumulator())
                include_all = cutoff is None or m.last_step <= cutoff
                if m.kind is DumpKind.SNAPSHOT and include_all:
                    acc.snapshot_version = m.version
                for shard in m.shards_of(table):
                    ref = ShardRef(dump_dir, shard, m.version)
                    cols = _read_columns(root, ref, [codec.KEY, codec.OP, codec.STEP])
                    steps = np.asarray(cols[codec.STEP], dtype=np.int64)
                    keep = (
                        np.ones(len(steps), bool)
                        if cutoff is None or include_all
                        else steps <= cutoff
                    )
                    refs.append(ref)
                    acc.add(len(refs) - 1, m.version, cols, keep)
            if gen != generation:
                specs = {**root.read_generation(run, gen).tables, **specs}
    tables: dict[str, ExpectedTable] = {}
    for table, acc in accs.items():
        if table not in specs:
            raise ArtifactError(
                root.url(root.generation_file(run, generation)),
                f"dumps hold table {table!r} that no GENERATION.json of the lineage describes",
            )
        keys, versions, ops, steps, ref_idx, row_idx = acc.resolve()
        tables[table] = ExpectedTable(
            table, specs[table], keys, versions, ops, steps, refs, ref_idx, row_idx, root
        )
    for table, spec in specs.items():
        if table not in tables:
            e64 = np.empty(0, np.int64)
            tables[table] = ExpectedTable(table, spec, e64, e64, np.empty(0, np.int8), e64)
            tables[table]._root = root
    version = manifests[-1].version if manifests else 0
    return ExpectedState(run, generation, through_seq, version, tables, manifests)


def keys_published_after(root: ArtifactRoot, run: str, parent: Parent) -> dict[str, np.ndarray]:
    """Keys, per table, that a generation restored at ``parent`` must republish.

    A dump row is "after the restore point" unless it belongs to the restored lineage's past:
    rows of the parent generation (and of its ancestors, up to each branch point) read at or
    before the checkpoint step are consistent with the restored model; every other row of every
    generation of the run (newer generations, sibling branches, rows after a branch point) may
    have reached serving with a value the restored model does not hold.

    Returns:
        table id -> sorted unique int64 keys.
    """
    past: dict[int, int] = {}
    chain = root.lineage(run, parent.generation)
    for i, info in enumerate(chain):
        child_parent = chain[i + 1].parent if i + 1 < len(chain) else parent
        assert child_parent is not None
        past[info.generation] = child_parent.checkpoint_step
    found: dict[str, list[np.ndarray]] = {}
    for gen in root.list_generations(run):
        limit = past.get(gen)
        for seq in root.list_dumps(run, gen):
            m = root.read_manifest(run, gen, seq)
            if limit is not None and m.last_step <= limit:
                continue
            dump_dir = root.dump_dir(run, gen, seq)
            for shard in m.shards:
                ref = ShardRef(dump_dir, shard, m.version)
                cols = _read_columns(root, ref, [codec.KEY, codec.STEP])
                keys = np.asarray(cols[codec.KEY], dtype=np.int64)
                if limit is not None:
                    keys = keys[np.asarray(cols[codec.STEP], dtype=np.int64) > limit]
                found.setdefault(shard.table, []).append(keys)
    return {t: np.unique(np.concatenate(parts)) for t, parts in found.items()}
