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

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from deltarec.artifacts import codec, pacing
from deltarec.artifacts.base import BaseInfo, list_bases, part_shard, read_base, usable_base
from deltarec.artifacts.expected import (
    ExpectedRows,
    ExpectedTable,
    ShardRef,
    _read_columns,
)
from deltarec.artifacts.root import ArtifactRoot
from deltarec.artifacts.types import DumpKind, Manifest, Op, Parent
from deltarec.artifacts.wholeshard import CheckedShards
from deltarec.errors import ArtifactError, BadInputError


@dataclass
class ExpectedState:
    """The expected serving state of a generation through a dump."""

    run: str
    generation: int
    through_seq: int | None
    version: int  # version of the newest dump included (0 if none)
    tables: dict[str, ExpectedTable]
    manifests: list[Manifest]  # every dump included after the base, in version order
    base: BaseInfo | None = None  # the base the replay started from

    def shard_refs(self) -> list[ShardRef]:
        """Every part of the base and shard of every included dump (for checksums)."""
        dumps = [
            ShardRef(dump_dir, s, m.version) for m, dump_dir in self._dump_dirs() for s in m.shards
        ]
        root = next((t._root for t in self.tables.values() if t._root is not None), None)
        if self.base is None or root is None:
            return dumps
        b = self.base
        base_dir = root.base_dir(b.run, b.generation, b.through_seq)
        return [ShardRef(base_dir, part_shard(p), b.through_version) for p in b.parts] + dumps

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

    def add(
        self,
        ref_no: int | np.ndarray,
        version: int | np.ndarray,
        cols: dict[str, np.ndarray],
        keep: np.ndarray | None = None,
        rows: np.ndarray | None = None,
    ) -> None:
        """The records of one shard; ``keep``: which of its rows count (None: all of them).

        Every row kept is the common case (thousands of small shards a dump with hundreds of
        ranks): then the columns are taken as they are, without a mask and its copies. Several
        shards at once (:meth:`add_group`): ``ref_no`` and ``rows`` per row.
        """
        keys = np.asarray(cols[codec.KEY], dtype=np.int64)
        ops = np.asarray(cols[codec.OP], dtype=np.int8)
        steps = np.asarray(cols[codec.STEP], dtype=np.int64)
        n = len(keys)
        rows = np.arange(n, dtype=np.int64) if rows is None else rows
        refs = np.full(n, ref_no, np.int32) if isinstance(ref_no, int) else ref_no
        if keep is not None and not keep.all():
            keys, ops, steps, rows, refs = (
                keys[keep],
                ops[keep],
                steps[keep],
                rows[keep],
                refs[keep],
            )
            if not isinstance(version, int):
                version = version[keep]
            n = len(keys)
        versions = np.full(n, version, np.int64) if isinstance(version, int) else version
        self.parts.append((keys, versions, ops, steps, refs, rows))

    def add_group(
        self,
        first_ref: int,
        counts: list[int],
        version: int,
        cols: dict[str, np.ndarray],
        keep: np.ndarray | None = None,
    ) -> None:
        """The records of consecutive refs ``first_ref, ...`` of ``counts`` rows each.

        Their columns one after the other: a dump's shards of one table read as a group.
        """
        sizes = np.asarray(counts, np.int64)
        refs = np.repeat(np.arange(first_ref, first_ref + len(sizes), dtype=np.int32), sizes)
        starts = np.cumsum(sizes) - sizes
        rows = np.arange(int(sizes.sum()), dtype=np.int64) - np.repeat(starts, sizes)
        self.add(refs, version, cols, keep, rows)

    def resolve(self) -> tuple[np.ndarray, ...]:
        if not self.parts:
            e64 = np.empty(0, np.int64)
            return e64, e64, np.empty(0, np.int8), e64, np.empty(0, np.int32), e64
        keys, versions, ops, steps, refs, rows = (
            np.concatenate(c) for c in zip(*self.parts, strict=True)
        )
        if len(keys) > 1 and not (keys[1:] > keys[:-1]).all():
            order = _latest_last(keys, versions)
            keys = keys[order]
            last = np.ones(len(keys), dtype=bool)
            last[:-1] = keys[1:] != keys[:-1]
            pick = order[last]
            keys, versions, ops = keys[last], versions[pick], ops[pick]
            steps, refs, rows = steps[pick], refs[pick], rows[pick]
        out = [keys, versions, ops, steps, refs, rows]  # ops and refs are fresh arrays here
        if self.snapshot_version >= 0:
            removed = out[1] < self.snapshot_version
            out[2][removed] = Op.EVICTED
            out[4][removed] = -1  # no row to load: removed by the snapshot
        return tuple(out)


def _latest_last(keys: np.ndarray, versions: np.ndarray) -> np.ndarray:
    """The order sorting records by key, then version (the latest record of a key last).

    Records are added dump by dump in lineage order, so versions usually never decrease
    along the concatenation; then a stable sort by key alone gives the same order, and
    numpy's stable sort (timsort) is nearly linear on the already sorted runs of each shard.
    """
    if (versions[1:] >= versions[:-1]).all():
        # numpy's default sort is several times faster than its stable one on int64 keys;
        # where no key repeats (one dump's keys, or dumps of disjoint keys) it orders alike.
        order = np.argsort(keys)
        ordered = keys[order]
        if (ordered[1:] != ordered[:-1]).all():
            return order
        return np.argsort(keys, kind="stable")
    return np.lexsort((versions, keys))


def cutoffs(root: ArtifactRoot, run: str, generation: int) -> list[tuple[int, int | None]]:
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
    root: ArtifactRoot,
    run: str,
    generation: int,
    through_seq: int | None = None,
    *,
    only: Collection[str] | None = None,
    checked: CheckedShards | None = None,
) -> ExpectedState:
    """The expected serving state of ``generation`` through dump ``through_seq`` (all if None).

    The replay starts from the newest committed base that fits (SPEC §3a,
    :func:`~deltarec.artifacts.base.usable_base`) and reads only the dumps after it. With
    ``only``, the rows of those tables alone are read (a compaction partition's): the other
    tables are in the result with their spec but no record.

    Raises:
        BadInputError: if ``through_seq`` names no committed dump of the generation.
        ArtifactError: if an artifact is missing, malformed or of an unknown schema version.
        MissingDumpError: if a dump after the base is missing (the chain has a hole).
    """
    committed = root.list_dumps(run, generation)  # the chain checked, base or not
    if through_seq not in (None, *committed) and (generation, through_seq) not in list_bases(
        root, run
    ):
        raise BadInputError(
            f"run {run!r} generation {generation} has no committed dump {through_seq} "
            f"under {root.uri} (committed: {committed})"
        )
    chain = cutoffs(root, run, generation)
    base = usable_base(root, run, chain, through_seq)
    folded = {e.generation: e.through_seq for e in base.lineage} if base else {}
    specs = dict(root.read_generation(run, generation).tables)
    accs: dict[str, _Accumulator] = {}
    refs: list[ShardRef] = []
    manifests: list[Manifest] = []
    if base is not None:
        _add_base(root, base, accs, refs, only, checked)
        specs = {**base.tables, **specs}
    last_folded = base.generation if base else None
    for gen, cutoff in chain:
        if gen in folded and gen != last_folded:
            continue  # an ancestor the base folds up to its cutoff
        seqs = root.list_dumps(run, gen)
        _check_replayable(root, run, gen, seqs, folded.get(gen, -1), generation, through_seq)
        for seq in seqs:
            if seq <= folded.get(gen, -1):
                continue
            if gen == generation and through_seq is not None and seq > through_seq:
                break
            m = root.read_manifest(run, gen, seq)
            if cutoff is not None and m.first_step > cutoff:
                break
            manifests.append(m)
            _add_dump(root, m, cutoff, accs, refs, only, checked)
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
        pacing.checkpoint()  # a paced compaction's chunk: one table's records resolved
        tables[table] = ExpectedTable(
            table, specs[table], keys, versions, ops, steps, refs, ref_idx, row_idx, root, checked
        )
    for table, spec in specs.items():
        if table not in tables:
            e64 = np.empty(0, np.int64)
            tables[table] = ExpectedTable(table, spec, e64, e64, np.empty(0, np.int8), e64)
            tables[table]._root = root
    if checked is not None:  # hold only the shards some record's row lies in
        used = {int(r) for t in tables.values() for r in np.unique(t._ref_idx[t._ref_idx >= 0])}
        checked.keep_only({(refs[r].dump_dir, refs[r].shard.path) for r in used})
    version = manifests[-1].version if manifests else (base.through_version if base else 0)
    return ExpectedState(run, generation, through_seq, version, tables, manifests, base)


def _check_replayable(
    root: ArtifactRoot,
    run: str,
    gen: int,
    seqs: list[int],
    folded: int,
    generation: int,
    through_seq: int | None,
) -> None:
    """Refuse a replay of ``gen`` whose first dumps retention removed (a base covers them).

    :meth:`~ArtifactRoot.list_dumps` lets a dump that a base covers be gone; a point older
    than every base that fits would then be replayed without it, silently.
    """
    if not seqs:
        return
    start = folded + 1 if folded >= 0 else min(seqs[0], 1)
    end = through_seq if gen == generation and through_seq is not None else seqs[-1]
    gone = [s for s in range(start, end + 1) if s not in set(seqs)]
    if gone:
        point = f"dump {through_seq}" if through_seq is not None else "its newest dump"
        raise BadInputError(
            f"run {run!r} generation {gen}: dumps {gone[0]}-{gone[-1]}, needed to read "
            f"generation {generation} through {point}, were removed by retention and no base "
            "that fits the point covers them"
        )


def _add_base(
    root: ArtifactRoot,
    base: BaseInfo,
    accs: dict[str, _Accumulator],
    refs: list[ShardRef],
    only: Collection[str] | None = None,
    checked: CheckedShards | None = None,
) -> None:
    """Every part of ``base`` as records (each row keeps the version of the dump that wrote it)."""
    base_dir = root.base_dir(base.run, base.generation, base.through_seq)
    for part in base.parts:
        if only is not None and part.table not in only:
            continue
        ref = ShardRef(base_dir, part_shard(part), base.through_version)
        cols = _read_columns(root, ref, [codec.KEY, codec.OP, codec.STEP, codec.VERSION], checked)
        refs.append(ref)
        versions = np.asarray(cols[codec.VERSION], dtype=np.int64)
        accs.setdefault(part.table, _Accumulator()).add(len(refs) - 1, versions, cols)
        pacing.checkpoint()  # a paced compaction's chunk: one part read


def _add_dump(
    root: ArtifactRoot,
    m: Manifest,
    cutoff: int | None,
    accs: dict[str, _Accumulator],
    refs: list[ShardRef],
    only: Collection[str] | None = None,
    checked: CheckedShards | None = None,
) -> None:
    """The records of one dump; of a parent, only rows read at or before ``cutoff``."""
    dump_dir = root.dump_dir(m.run, m.generation, m.seq)
    include_all = cutoff is None or m.last_step <= cutoff
    tables = [t for t in m.tables if only is None or t in only]
    groups = [m.shards_of(table) for table in tables]
    for i, (table, shards) in enumerate(zip(tables, groups, strict=True)):
        acc = accs.setdefault(table, _Accumulator())
        if m.kind is DumpKind.SNAPSHOT and include_all:
            acc.snapshot_version = m.version
        columns = [codec.KEY, codec.OP, codec.STEP]
        group = None
        if checked is not None and len(shards) > 1:  # a rank's shard each: read as one block
            checked.prefetch(dump_dir, [g for g in groups[i:] if len(g) > 1])
            group = checked.read_group(dump_dir, shards, columns)
        if group is not None:
            keep = _before(group, cutoff) if not include_all else None
            acc.add_group(len(refs), [s.rows for s in shards], m.version, group, keep)
            refs.extend(ShardRef(dump_dir, shard, m.version) for shard in shards)
            pacing.checkpoint()
            continue
        for shard in shards:
            ref = ShardRef(dump_dir, shard, m.version)
            cols = _read_columns(root, ref, columns, checked)
            keep = _before(cols, cutoff) if not include_all else None
            refs.append(ref)
            acc.add(len(refs) - 1, m.version, cols, keep)
            pacing.checkpoint()  # a paced compaction's chunk: one shard read


def _before(cols: dict[str, np.ndarray], cutoff: int | None) -> np.ndarray | None:
    """Which rows of a parent's dump past the cutoff count: those read at or before it."""
    if cutoff is None:
        return None
    return np.asarray(cols[codec.STEP], dtype=np.int64) <= cutoff


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
    _published_in_bases(root, run, past, found)
    return {t: np.unique(np.concatenate(parts)) for t, parts in found.items()}


def _published_in_bases(
    root: ArtifactRoot, run: str, past: dict[int, int], found: dict[str, list[np.ndarray]]
) -> None:
    """Add the keys whose record in a committed base lies outside the restored past.

    Retention deletes dumps a base covers; the base keeps each key's newest record, whose
    version and step are at least those of any row of the key it folded (steps only grow
    within a generation), so a key a deleted dump wrote after the restore point has a record
    outside the past in the base that covers that dump. Keys republished twice are harmless.
    """
    for g, s in list_bases(root, run):
        base = read_base(root, run, g, s)
        base_dir = root.base_dir(run, g, s)
        for part in base.parts:
            ref = ShardRef(base_dir, part_shard(part), base.through_version)
            cols = _read_columns(root, ref, [codec.KEY, codec.STEP, codec.VERSION])
            keys = np.asarray(cols[codec.KEY], dtype=np.int64)
            gens = np.asarray(cols[codec.VERSION], dtype=np.int64) >> 32
            limits = np.full(len(keys), np.iinfo(np.int64).min, np.int64)
            for gen, limit in past.items():
                limits[gens == gen] = limit
            after = np.asarray(cols[codec.STEP], dtype=np.int64) > limits
            found.setdefault(part.table, []).append(keys[after])


__all__ = [
    "ExpectedRows",
    "ExpectedState",
    "ExpectedTable",
    "ShardRef",
    "expected_state",
    "keys_published_after",
]
