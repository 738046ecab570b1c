"""Rollback: restore serving to the state of a promoted generation (SPEC §7).

A rollback never rewrites history. It writes a **new generation** in the artifact root whose
one committed dump republishes, at the new generation's (higher) version, the value every key
had at the target point, and deletes (``op = 1``) the keys that did not exist then; then it
publishes that dump like any other and records the rollback in the store's registry.

* The target point is ``to_generation`` through the dump it was last promoted at (from the
  store's serving history), or an explicit ``through_seq``.
* The keys to restore are every key that any committed dump of the run wrote at a version
  newer than the target point: later dumps of the target generation, later generations
  (children, siblings, earlier rollbacks).
* The new generation's GENERATION.json has ``parent = {generation: G, checkpoint_step: the
  target dump's last step}`` (so its own expected state is G's state plus the restored rows)
  and ``"rollback": {"to_generation": G, "through_seq": S, "version": ..., "keys_restored":
  ..., "keys_removed": ...}``. Verification of G through S compares rows of such a
  generation by value against G's expected state (see :mod:`deltarec.verify`), so verify of
  the target passes afterwards.
* The dump is committed with :func:`~deltarec.artifacts.writer.write_dump` (its shards
  first, MANIFEST.json last) before any row is published: as for training dumps, the store
  never holds a row that no committed dump holds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from deltarec.artifacts import codec
from deltarec.artifacts.lineage import ExpectedState, ExpectedTable, expected_state
from deltarec.artifacts.newer import newer_records
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
from deltarec.errors import BadInputError
from deltarec.ids import make_version
from deltarec.promote.promote import resolve_seq
from deltarec.publish import DumpPublisher
from deltarec.stores.base import Store
from deltarec.stores.types import ServingPointer

log = logging.getLogger(__name__)

ROLLBACK_SEQ = 1
"""The seq of a rollback generation's single dump (a delta; no snapshot)."""


@dataclass
class RollbackResult:
    """What a rollback did.

    Attributes:
        run, to_generation, through_seq: the restored point.
        generation: the new rollback generation (None if nothing had changed since the point).
        version: the version the restored rows were published at.
        restored: table -> keys republished with their value at the point.
        removed: table -> keys deleted (they did not exist at the point).
        pointer: the serving pointer recorded in the store's registry.
    """

    run: str
    to_generation: int
    through_seq: int
    generation: int | None
    version: int | None
    restored: dict[str, int] = field(default_factory=dict)
    removed: dict[str, int] = field(default_factory=dict)
    pointer: ServingPointer | None = None


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
) -> RollbackResult:
    """Restore every key changed after ``to_generation``'s promoted point to its value then.

    Args:
        root: the artifact root (a new generation is written there).
        run: the run name.
        store: the open store to restore.
        to_generation: the generation to restore.
        through_seq: the dump to restore to; default: the one the generation was last
            promoted at.

    Raises:
        BadInputError: no such generation or dump, or never promoted (without through_seq).
    """
    if through_seq is None:
        through_seq = promoted_seq(store, run, to_generation)
    seq = resolve_seq(root, run, to_generation, through_seq)
    point = make_version(to_generation, seq)
    state = expected_state(root, run, to_generation, seq)
    changed, specs = keys_changed_after(root, run, point)
    result = RollbackResult(run, to_generation, seq, None, None)
    if changed:
        rows = {t: restore_rows(state, t, specs[t], keys) for t, keys in changed.items()}
        manifest = _write_rollback_generation(root, run, state, seq, specs, rows)
        result.generation, result.version = manifest.generation, manifest.version
        for t, r in rows.items():
            result.restored[t] = int((r.ops == Op.UPSERT).sum())
            result.removed[t] = int((r.ops == Op.EVICTED).sum())
        DumpPublisher(store, root, run).publish_dump(manifest, 0, rows)
    note = f"rollback to generation {to_generation} dump {seq}"
    if result.generation is not None:
        note += (
            f": generation {result.generation} republished {sum(result.restored.values())} "
            f"keys and removed {sum(result.removed.values())}"
        )
    result.pointer = store.registry.set_serving(run, to_generation, seq, note=note)
    log.info("%s", note)
    return result


# ---- what changed -----------------------------------------------------------------------------
def keys_changed_after(
    root: ArtifactRoot, run: str, point: int
) -> tuple[dict[str, np.ndarray], dict[str, TableSpec]]:
    """Keys, per table, that any committed dump of ``run`` wrote at a version above ``point``.

    Returns:
        ``(table -> sorted unique keys, table -> spec from the newest generation naming it)``.
    """
    newer = newer_records(root, run, point)
    keys = {t: r.keys for t, r in newer.items() if len(r.keys)}
    return keys, {t: newer[t].spec for t in keys}


def restore_rows(state: ExpectedState, table: str, spec: TableSpec, keys: np.ndarray) -> ShardRows:
    """The rows that put ``keys`` back to their state at the point.

    A key present then gets its row then (``op = 0``, its step then); a key absent then gets
    ``op = 1`` with the table's fallback row at the point for a ZCH table (zeros elsewhere).
    """
    width = codec.encoded_width(spec.dtype, spec.dim)
    element = codec.element_type(spec.dtype)
    n = len(keys)
    out = ShardRows(
        keys=np.asarray(keys, np.int64),
        embedding=np.zeros((n, width), element),
        ops=np.full(n, Op.EVICTED, np.int8),
        steps=np.zeros(n, np.int64),
    )
    et = state.tables.get(table)
    if et is not None and len(et.keys):
        idx = et.index_of(out.keys)
        present = idx >= 0
        present[present] = et.present[idx[present]]
        out.ops[present] = Op.UPSERT
        out.steps[idx >= 0] = et.steps[idx[idx >= 0]]
        if present.any():
            out.embedding[present] = et.load(out.keys[present])
        absent = ~present
        if absent.any() and spec.kind is TableKind.ZCH:
            fallback = _fallback_row(et)
            if fallback is not None:
                out.embedding[absent] = fallback
    return out


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
    rows: dict[str, ShardRows],
) -> Manifest:
    target = root.read_manifest(run, state.generation, seq)
    step = target.last_step
    tables = {**root.read_generation(run, state.generation).tables, **specs}
    info = GenerationInfo(
        run=run,
        generation=root.latest_generation(run) + 1,
        world_size=1,
        tables=tables,
        parent=Parent(state.generation, step),
        extra={
            ROLLBACK_FIELD: {
                "to_generation": state.generation,
                "through_seq": seq,
                "version": make_version(state.generation, seq),
                "keys_restored": int(sum((r.ops == Op.UPSERT).sum() for r in rows.values())),
                "keys_removed": int(sum((r.ops == Op.EVICTED).sum() for r in rows.values())),
            }
        },
    )
    info = root.allocate_generation(info)
    return write_dump(
        root,
        info,
        ROLLBACK_SEQ,
        DumpKind.DELTA,
        {t: {0: r} for t, r in sorted(rows.items())},
        first_step=step,
        last_step=step,
        extra={ROLLBACK_FIELD: info.extra[ROLLBACK_FIELD]},
    )
