"""Sampled verify's key count: rows the lineage never wrote, or keys missing, outside the sample.

A sample reads only keys the artifacts name, so a row the lineage never wrote (or a key it
removed that the store kept) is never among them. :func:`check_key_count` compares, per table,
the number of keys the store's live view holds (:meth:`Store.count_keys`, one count on the
server) with the number the expected state holds present. The count says *that* the store
holds other keys, not which: ``verify --all`` names them.

The count is compared only where it is meaningful, and a note says why it was not elsewhere:
the store must be able to count (``capabilities.scan``) and to delete (where it cannot, evicted
ids hold the fallback row); the table must be read live (a staged generation's count is only
known after promote merges it); the verification must cover every partition; and the store
must hold nothing of the run newer than the point verified (a progress mark of a later dump or
generation, other than a rollback to this point, on this table's live view): verifying an older
point after serving moved on is legitimate and its count differs.
"""

from __future__ import annotations

from deltarec.artifacts.lineage import ExpectedTable
from deltarec.artifacts.types import FALLBACK_KEY
from deltarec.ids import make_version
from deltarec.stores.base import Store
from deltarec.verify.types import VerifyResult

NOT_COUNTED = {
    "capability": "the {kind} store cannot count or delete its keys: sampled verify did not "
    "look for rows the lineage never wrote",
    "staged": "tables read through a staging view were not counted (their keys are known after "
    "promote merges them): sampled verify did not look for rows the lineage never wrote there",
    "partition": "a verify partition does not count a table's keys",
    "newer": "the store holds dumps of run {run!r} newer than the point verified: sampled "
    "verify did not compare key counts (use --all)",
    "no marks": "the store keeps no progress marks of the generation verified (a replica "
    "applies whole dumps), so whether it holds newer dumps is unknown: sampled verify did not "
    "compare key counts (use --all)",
}


def count_keys(
    result: VerifyResult,
    table: ExpectedTable,
    store: Store,
    *,
    staged: bool,
    partitioned: bool,
    newer: set[str] | None,
) -> None:
    """Compare one table's key count in the store with the expected state's (a sample's check).

    Sets the table's ``store_keys`` and ``key_count_problem``; where the count is not compared
    a note in ``result.notes`` says why (once).
    """
    res = result.tables[table.table]
    caps = store.capabilities
    note = ""
    if not (caps.scan and caps.deletes):
        note = NOT_COUNTED["capability"].format(kind=store.kind)
    elif partitioned:
        note = NOT_COUNTED["partition"]
    elif staged:
        note = NOT_COUNTED["staged"]
    elif newer is None:
        note = NOT_COUNTED["no marks"]
    elif table.table in newer:
        note = NOT_COUNTED["newer"].format(run=result.run)
    if note:
        if note not in result.notes:
            result.notes.append(note)
        return
    expected = int(table.present.sum())
    if not caps.fallback_key:
        expected -= int(table.present[table.keys == FALLBACK_KEY].sum())
    res.store_keys = held = store.count_keys(table.table)
    if held > expected:
        what = f"{held - expected} more: rows the lineage never wrote, or keys it removed"
    elif held < expected:
        what = f"{expected - held} fewer: keys missing"
    else:
        return
    res.key_count_problem = (
        f"the store holds {held} keys, the expected state {expected} ({what}; "
        "`verify --all` names them)"
    )


def newer_tables(
    store: Store, run: str, point_version: int, rollbacks: frozenset[int]
) -> set[str] | None:
    """The tables of ``run`` that took rows of a dump newer than the point (progress marks).

    A mark of a later dump or generation, rollbacks to the point excepted, into the live view
    or a staging view (merged by now, or to be merged by a promote): such a table's count may
    differ from the point's without anything being wrong. None where the store keeps no marks
    of the point's generation (it cannot tell). Nothing is read for a store that cannot count.
    """
    if not (store.capabilities.scan and store.capabilities.deletes):
        return set()
    registry = store.registry
    point_generation = point_version >> 32
    own = registry.progress(run, point_generation)  # read once: a mark a part, thousands
    if not own:
        return None
    out: set[str] = set()
    for generation in registry.generations(run):
        if generation < point_generation or generation in rollbacks:
            continue
        marks = own if generation == point_generation else registry.progress(run, generation)
        for mark in marks:
            if make_version(mark.generation, mark.seq) > point_version:
                out.add(mark.table)
    return out


__all__ = ["NOT_COUNTED", "count_keys", "newer_tables"]
