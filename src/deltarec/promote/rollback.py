"""Rollback: restore serving to exactly a promoted generation's expected state (SPEC §7).

A rollback never rewrites history. It writes a **new generation** in the artifact root whose
one committed dump is a **snapshot** of the target point: every key the target generation
held through the dump it was promoted at, with its value then, republished at the new
generation's (higher) version. Publishing a snapshot removes every key it lacks from the run's
live views (:mod:`deltarec.publish.snapshot`), so afterwards the run's views hold exactly the
target's expected state (the one ``verify --generation G --all`` computes):

* keys a newer dump changed get their value at the point back;
* keys a newer snapshot removed (a fresh retrain's snapshot drops every ZCH id it has not
  admitted) come back;
* keys a newer generation added go (rows of other runs live in their own views and are never
  touched; serving stops reading them because the rollback makes the run serve again).

A store that cannot remove rows (``capabilities.snapshot_replace`` False: PAI FeatureStore)
gets, in the same dump, an ``op = 1`` row for each key a newer dump wrote that the point does
not hold: its fallback row (the row the key's own record carries where the point has one).

Then the rollback records the serving pointer (which makes the run serve every table it has a
live view of) and **verifies the result itself** with the verify engine against the target
point (every key unless told to sample; ``--all`` semantics: a store that can list its keys is
also scanned for rows the point does not hold). A row still newer than the point (SUPERSEDED)
fails that check too: after a rollback nothing of a newer dump may be left. A failed check
raises :class:`RollbackCheckError` naming what differs; the rows stay as written (they are a
committed dump's) and a new rollback is the way forward.

The cost is proportional to the target's tables (one snapshot of them), not to the history
after the point; only a store that cannot remove rows reads the keys newer dumps wrote.

The new generation's GENERATION.json has ``parent = {generation: G, checkpoint_step: the
target dump's last step}`` and ``"rollback": {"to_generation": G, "through_seq": S, "version":
..., "keys_restored": ..., "keys_removed": ...}``; verification of G through S compares the
rows of such a generation by value against G's expected state (see :mod:`deltarec.verify`).
The dump is committed with :func:`~deltarec.artifacts.writer.write_dump` (shards first,
MANIFEST.json last) before any row is published.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np

from deltarec.artifacts import codec
from deltarec.artifacts.lineage import ExpectedRows, ExpectedState, ExpectedTable, expected_state
from deltarec.artifacts.newer import newer_records, rollback_generations
from deltarec.artifacts.root import ArtifactRoot
from deltarec.artifacts.shards import ShardRows
from deltarec.artifacts.types import (
    FALLBACK_KEY,
    ROLLBACK_FIELD,
    DumpKind,
    GenerationInfo,
    Manifest,
    Op,
    Parent,
    TableKind,
    TableSpec,
)
from deltarec.artifacts.writer import write_dump
from deltarec.errors import BadInputError, CheckFailedError
from deltarec.ids import make_version
from deltarec.promote.promote import resolve_seq
from deltarec.publish import DumpPublisher
from deltarec.stores import Serving, who_serves
from deltarec.stores.base import Store
from deltarec.stores.types import ServingPointer
from deltarec.verify.engine import verify
from deltarec.verify.options import DEFAULT_FULL_SCAN_BYTES, DEFAULT_LOAD_CHUNK, VerifyOptions
from deltarec.verify.types import RowClass, VerifyResult

log = logging.getLogger(__name__)

ROLLBACK_SEQ = 1
"""The seq of a rollback generation's single dump (a snapshot)."""

CHUNK_KEYS = 1 << 16
"""Keys whose rows are loaded from the shards and written at once (bounds memory)."""


@dataclass
class RollbackResult:
    """What a rollback did.

    Attributes:
        run, to_generation, through_seq: the restored point.
        generation: the new rollback generation (None if nothing had changed since the point).
        version: the version the restored rows were published at.
        restored: table -> keys republished with their value at the point (every key the point
            holds).
        came_back: table -> of those, keys the run's view did not hold before the rollback
            (removed by a newer snapshot or delete); counted where the store can list keys.
        removed: table -> keys the view held that the point does not (removed by the
            snapshot, or given their fallback row where the store cannot delete); counted
            where the store can list keys, else the keys a newer dump wrote.
        pointer: the serving pointer recorded in the store's registry.
        serving_before, serving_after: who served the store before and after.
        verification: the check of the store against the point, after the rollback.
    """

    run: str
    to_generation: int
    through_seq: int
    generation: int | None
    version: int | None
    restored: dict[str, int] = field(default_factory=dict)
    came_back: dict[str, int] = field(default_factory=dict)
    removed: dict[str, int] = field(default_factory=dict)
    pointer: ServingPointer | None = None
    serving_before: Serving | None = None
    serving_after: Serving | None = None
    verification: VerifyResult | None = None

    @property
    def passed(self) -> bool:
        """Whether the store was verified equal to the point after the rollback."""
        return self.verification is not None and self.verification.passed


class RollbackCheckError(CheckFailedError):
    """The store does not equal the target point after a rollback (CLI exit code 1)."""

    def __init__(self, result: RollbackResult) -> None:
        self.result = result
        v = result.verification
        what = v.failure_summary() if v is not None else "not verified"
        super().__init__(
            f"rollback of run {result.run!r} to generation {result.to_generation} dump "
            f"{result.through_seq}: the store does not equal that point afterwards: {what}"
        )


def promoted_seq(store: Store, run: str, generation: int) -> int:
    """The dump ``generation`` was last promoted at, from the store's serving history.

    Raises:
        BadInputError: the generation was never promoted in this store.
    """
    for pointer in reversed(store.registry.serving_history(run)):
        if pointer.generation == generation:
            return pointer.seq
    raise BadInputError(
        f"run {run!r} generation {generation} was never promoted in {store.describe()}; "
        "roll back to a promoted generation, or name the dump with --through-seq"
    )


def rollback(
    root: ArtifactRoot,
    run: str,
    store: Store,
    to_generation: int,
    through_seq: int | None = None,
    *,
    sample: int | None = None,
) -> RollbackResult:
    """Make ``run``'s views equal ``to_generation``'s expected state, serve them, and check it.

    Args:
        root: the artifact root (a new generation is written there).
        run: the run name.
        store: the open store to restore (a handle of ``run``).
        to_generation: the generation to restore.
        through_seq: the dump to restore to; default: the one the generation was last
            promoted at.
        sample: keys per table the closing check reads; None (the default) checks every key.

    Raises:
        BadInputError: no such generation or dump, or never promoted (without through_seq);
            or the generation was published here from other artifacts (another lineage
            under the run's name: nothing is written).
        RollbackCheckError: the store does not equal the point afterwards (names what differs).
    """
    if through_seq is None:
        through_seq = promoted_seq(store, run, to_generation)
    seq = resolve_seq(root, run, to_generation, through_seq)
    if to_generation in store.registry.generations(run):  # the point's lineage (docs/runs.md)
        origin = root.read_generation(run, to_generation).created_at or None
        store.registry.register_generation(run, to_generation, origin)
    result = RollbackResult(run, to_generation, seq, None, None)
    result.serving_before = who_serves(store)
    state = expected_state(root, run, to_generation, seq)
    extra = _tables_beyond(root, run, store, state)
    unchanged = not (changed_after(root, run, to_generation, seq) or extra)
    if unchanged:  # nothing committed since: the store may already equal the point
        result.verification = check_point(root, run, store, to_generation, seq, extra, sample)
    if not unchanged or not result.passed:  # else a row was lost or written behind our back
        _restore(root, run, store, state, seq, extra, result)
        result.verification = None
    note = f"rollback to generation {to_generation} dump {seq}"
    if result.generation is not None:
        note += (
            f": generation {result.generation} republished {sum(result.restored.values())} "
            f"keys and removed {sum(result.removed.values())}"
        )
    result.pointer = store.registry.set_serving(run, to_generation, seq, note=note)
    result.serving_after = who_serves(store)
    log.info("%s; serving before: %s; after: %s", note, result.serving_before.describe(),
             result.serving_after.describe())  # fmt: skip
    if result.verification is None:
        result.verification = check_point(root, run, store, to_generation, seq, extra, sample)
    log.info("rollback check of run %s generation %d dump %d: %s", run, to_generation, seq,
             "passed" if result.passed else result.verification.failure_summary())  # fmt: skip
    if not result.passed:
        raise RollbackCheckError(result)
    return result


def changed_after(root: ArtifactRoot, run: str, generation: int, seq: int) -> bool:
    """Whether ``run`` committed a dump newer than the point.

    Rollbacks to exactly that point do not count: their rows are the point's values.
    """
    point = make_version(generation, seq)
    same = rollback_generations(root, run, generation, seq)
    for gen in root.list_generations(run):
        if gen < generation or gen in same:
            continue
        if any(make_version(gen, s) > point for s in root.list_dumps(run, gen)):
            return True
    return False


def check_point(
    root: ArtifactRoot,
    run: str,
    store: Store,
    generation: int,
    seq: int,
    extra: dict[str, TableSpec] | None = None,
    sample: int | None = None,
) -> VerifyResult:
    """Verify ``store`` against the point, strictly: nothing newer may be left either.

    What ``verify --generation G --through-seq S --all`` checks, and a row of a newer dump
    (SUPERSEDED, which verify of an older point accepts) fails; so does a row in a table the
    point does not have (``extra``), where the store can list its keys.
    """
    result = verify(
        root,
        run,
        store,
        VerifyOptions(sample=sample),
        store_url=store.describe(),
        generation=generation,
        through_seq=seq,
    )
    for table, res in sorted(result.tables.items()):
        n = res.counts.get(RowClass.SUPERSEDED, 0)
        if n:
            keys = [m.key for m in res.mismatches if m.row_class is RowClass.SUPERSEDED][:3]
            example = f" (e.g. key {', '.join(map(str, keys))})" if keys else ""
            result.errors.append(
                f"table {table!r}: {n} key(s) still hold a newer dump's row or deletion "
                f"(SUPERSEDED){example}"
            )
    if store.capabilities.scan:
        for table in sorted(extra or {}):
            n = sum(len(k) for k in store.scan_keys(table))
            if n:
                result.errors.append(
                    f"table {table!r}, which generation {generation} does not have, still "
                    f"holds {n} key(s)"
                )
    return result


# ---- the restore -------------------------------------------------------------------------------
def _restore(
    root: ArtifactRoot,
    run: str,
    store: Store,
    state: ExpectedState,
    seq: int,
    extra: dict[str, TableSpec],
    result: RollbackResult,
) -> None:
    """Write the rollback generation's snapshot of the point and publish it."""
    fallback_keys = {} if store.capabilities.snapshot_replace else _written_after(root, run, state)
    held = _held_keys(store, state, extra)
    specs = {t: et.spec for t, et in state.tables.items()} | extra
    for table, et in state.tables.items():
        present = et.present_keys()
        result.restored[table] = len(present)
        if table in held:
            result.came_back[table] = int((~np.isin(present, held[table])).sum())
            result.removed[table] = int((~np.isin(held[table], present)).sum())
        else:
            result.removed[table] = len(fallback_keys.get(table, ()))
    for table in extra:
        result.restored[table] = 0
        result.removed[table] = len(held.get(table, ()))
    manifest = _write_rollback_generation(root, run, state, seq, specs, fallback_keys, result)
    result.generation, result.version = manifest.generation, manifest.version
    DumpPublisher(store, root, run).publish_dump(manifest, 0)


def _tables_beyond(
    root: ArtifactRoot, run: str, store: Store, state: ExpectedState
) -> dict[str, TableSpec]:
    """Tables ``run`` has a live view of that the point does not have, with their newest spec.

    A newer generation added them; the rollback empties them.
    """
    names = sorted(set(store.views()) - set(state.tables))
    out: dict[str, TableSpec] = {}
    for gen in sorted(root.list_generations(run), reverse=True):
        if len(out) == len(names):
            break
        tables = root.read_generation(run, gen).tables
        out.update({t: tables[t] for t in names if t in tables and t not in out})
    return out


def _held_keys(
    store: Store, state: ExpectedState, extra: dict[str, TableSpec]
) -> dict[str, np.ndarray]:
    """The keys each table's live view holds now (for the counts).

    Only where the store can list its keys; nothing elsewhere.
    """
    if not store.capabilities.scan:
        return {}
    views = store.views()
    out = {}
    for table in [*state.tables, *extra]:
        if table in views:
            parts = list(store.scan_keys(table))
            out[table] = np.sort(np.concatenate(parts)) if parts else np.empty(0, np.int64)
    return out


def _written_after(root: ArtifactRoot, run: str, state: ExpectedState) -> dict[str, np.ndarray]:
    """Keys a dump newer than the point wrote that the point does not hold, per table.

    Only for a store that cannot remove rows: each gets an ``op = 1`` row (its fallback row).
    """
    out = {}
    for table, records in newer_records(root, run, state.version).items():
        et = state.tables.get(table)
        if et is None:
            continue
        idx = et.index_of(records.keys)
        held = np.zeros(len(idx), bool)
        held[idx >= 0] = et.present[idx[idx >= 0]]
        if (~held).any():
            out[table] = records.keys[~held]
    return out


def _rows(et: ExpectedTable, step: int, fallback_keys: np.ndarray | None) -> Iterator[ShardRows]:
    """The snapshot's rows of one table, in key order, a chunk at a time.

    Every key the point holds with its row (``op = 0``, its step then); and each of
    ``fallback_keys`` with ``op = 1`` and the row its own record carries, or the table's
    fallback row at the point (a ZCH table; zeros elsewhere) where it has no record.

    Rows are read as verify ``--all`` reads them: a table whose rows fit in
    :data:`~deltarec.verify.options.DEFAULT_FULL_SCAN_BYTES` streams from its shards' row
    groups (:class:`~deltarec.artifacts.lineage.ExpectedRows`, each row group decoded once
    while keys advance through the shards in order, else the table loaded once); a larger one
    is loaded by key in chunks of :data:`~deltarec.verify.options.DEFAULT_LOAD_CHUNK` keys.
    """
    present = et.present_keys()
    keys = present if fallback_keys is None else np.union1d(present, fallback_keys)
    spec = et.spec
    width = codec.encoded_width(spec.dtype, spec.dim)
    element = codec.element_type(spec.dtype)
    fallback = _fallback_row(et) if spec.kind is TableKind.ZCH else None
    if len(keys) == 0:
        yield ShardRows.empty(spec.dtype, spec.dim)
        return
    streamed = len(et.keys) * codec.row_bytes(spec.dtype, spec.dim) <= DEFAULT_FULL_SCAN_BYTES
    chunk_keys = CHUNK_KEYS if streamed else DEFAULT_LOAD_CHUNK
    with ExpectedRows(et) if streamed else nullcontext() as reader:
        for start in range(0, len(keys), chunk_keys):
            chunk = keys[start : start + chunk_keys]
            idx = et.index_of(chunk)
            known = idx >= 0
            ops = np.full(len(chunk), Op.EVICTED, np.int8)
            ops[known] = et.ops[idx[known]]
            steps = np.full(len(chunk), step, np.int64)
            steps[known] = et.steps[idx[known]]
            rows = np.zeros((len(chunk), width), element)
            if known.any():
                pos = idx[known]
                rows[known] = reader.take(pos) if reader is not None else et.load(chunk[known])
            if fallback is not None and not known.all():
                rows[~known] = fallback
            yield ShardRows(chunk, rows, ops, steps)


def _fallback_row(et: ExpectedTable) -> np.ndarray | None:
    idx = et.index_of(np.array([FALLBACK_KEY], np.int64))
    if idx[0] < 0 or not et.present[idx[0]]:
        return None
    return et.load(np.array([FALLBACK_KEY], np.int64))[0]


# ---- the rollback generation --------------------------------------------------------------------
def _write_rollback_generation(
    root: ArtifactRoot,
    run: str,
    state: ExpectedState,
    seq: int,
    specs: dict[str, TableSpec],
    fallback_keys: dict[str, np.ndarray],
    result: RollbackResult,
) -> Manifest:
    step = root.read_manifest(run, state.generation, seq).last_step
    record = {
        "to_generation": state.generation,
        "through_seq": seq,
        "version": make_version(state.generation, seq),
        "keys_restored": sum(result.restored.values()),
        "keys_removed": sum(result.removed.values()),
    }
    info = GenerationInfo(
        run=run,
        generation=root.latest_generation(run) + 1,
        world_size=1,
        tables=specs,
        parent=Parent(state.generation, step),
        extra={ROLLBACK_FIELD: record},
    )
    info = root.allocate_generation(info)
    rows: dict[str, dict[int, object]] = {}
    for table in sorted(specs):
        et = state.tables.get(table)
        if et is None:  # a table the point does not have: an empty snapshot empties it
            rows[table] = {0: ShardRows.empty(specs[table].dtype, specs[table].dim)}
        else:
            rows[table] = {0: _rows(et, step, fallback_keys.get(table))}
    return write_dump(
        root,
        info,
        ROLLBACK_SEQ,
        DumpKind.SNAPSHOT,
        rows,  # type: ignore[arg-type]
        first_step=step,
        last_step=step,
        extra={ROLLBACK_FIELD: record},
    )
