"""When a snapshot dump is complete, and what completing it does (SPEC §6), written once.

A snapshot dump replaces a table: once every rank's part of it is in the store (each rank's
progress mark for the table is complete), the keys it lacks are the keys whose version is older
than the snapshot's. Completing it removes them and makes the snapshot's version the view's
floor (:meth:`~deltarec.stores.Store.sweep_below`), then records it in the registry
(:meth:`~deltarec.stores.Registry.record_snapshot`). Published into staging views, the sweep
waits for ``merge_staging``, which applies every recorded, unswept snapshot of the generation.

Both steps are idempotent: after a crash between them the next call sweeps again (a no-op) and
records. A store that cannot remove rows (``capabilities.snapshot_replace`` False) writes a
snapshot like a delta, and the snapshot is never recorded as complete.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from deltarec.ids import make_version
from deltarec.stores.base import Store
from deltarec.stores.types import ProgressMark, SnapshotRecord


def finish_snapshot(
    store: Store,
    run: str,
    generation: int,
    seq: int,
    table: str,
    world_size: int,
    staging_generation: int | None = None,
    progress: Callable[[], Sequence[ProgressMark]] | None = None,
) -> bool:
    """Complete a snapshot dump of ``table`` once all ``world_size`` ranks' marks are complete.

    ``progress``: the generation's progress marks, for a caller completing several tables of
    one dump that reads them once (a dump of hundreds of ranks has a mark per rank and table:
    reading them all again for each table cost more than the tables' rows). None: read here.

    Returns:
        True if the snapshot is complete (now or before), False if ranks are missing or the
        store cannot remove the keys a snapshot lacks.
    """
    if not store.capabilities.snapshot_replace:
        return False
    registry = store.registry
    stage = int(staging_generation or 0)
    done = registry.snapshot(run, generation, seq, table)
    if done is not None and (done.swept_at is not None or stage):
        return True
    marks = registry.progress(run, generation) if progress is None else progress()
    complete = sum(1 for m in marks if m.seq == seq and m.table == table and m.complete)
    if complete < world_size:
        return False
    version = make_version(generation, seq)
    if not stage:
        store.sweep_below(table, version)
    swept_at = None if stage else time.time()
    registry.record_snapshot(SnapshotRecord(run, generation, seq, table, stage, version, swept_at))
    return True


__all__ = ["finish_snapshot"]
