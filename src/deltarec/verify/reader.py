"""Reading a store the way serving will see it, and the deletes a later dump made.

:class:`Reader` reads a batch of keys from the live view, merged with the generation's staging
view while a ``staged`` generation is not promoted yet. :class:`LaterDeletes` tells which keys a
dump newer than the verified point deleted (SUPERSEDED, not MISSING).
"""

from __future__ import annotations

import numpy as np

from deltarec.artifacts.newer import NewerRecords, newer_records
from deltarec.artifacts.root import ArtifactRoot
from deltarec.artifacts.types import DumpKind, Manifest
from deltarec.ids import split_version
from deltarec.stores.base import Store
from deltarec.verify.compare import ExpectedBatch, StoreBatch


class Reader:
    """Reads a batch of keys from the live view, merged with the generation's staging view.

    A generation published in ``staged`` mode is not live until promote merges it; before that,
    what serving *will* hold is, per key, the newer of the staging row and the live row (the
    versioned merge), minus what the merge's sweep removes: a snapshot of the generation that
    is complete but not swept yet (a fresh retrain's) replaces the table at the merge, so a
    row below its version is absent (SPEC §6). A table has a staging view only until promote
    drops it: the store's staging views of the generation are listed once; a store without
    staging (``capabilities.staging`` False) is read live only.
    """

    def __init__(self, store: Store, run: str, generation: int, manifests: list[Manifest]) -> None:
        self.store = store
        self.run = run
        self.generation = generation
        self._shards = {
            (m.seq, t): len(m.shards_of(t))
            for m in manifests
            if m.generation == generation
            for t in m.tables
        }
        self._snapshots = [
            m for m in manifests if m.generation == generation and m.kind == DumpKind.SNAPSHOT
        ]
        self._floors: dict[str, int] = {}
        self._staging: set[str] | None = None
        self._complete: set[tuple[int, str]] | None = None

    def staged(self, table: str) -> bool:
        """Whether ``table`` has a staging view of the generation (looked up once)."""
        if self._staging is None:
            self._staging = (
                set(self.store.views(staging_generation=self.generation))
                if self.store.capabilities.staging
                else set()
            )
        return table in self._staging

    def read(self, table: str, keys: np.ndarray) -> StoreBatch:
        """Rows of ``keys`` as serving holds them (after promote, for a staged generation)."""
        live = self._read(table, keys, None)
        if not self.staged(table):
            return live
        staged = self._read(table, keys, self.generation)
        take = staged.found & (~live.found | (staged.versions >= live.versions))
        versions = np.where(take, staged.versions, live.versions)
        found = (live.found | staged.found) & (versions >= self.pending_floor(table))
        return StoreBatch(found, versions, np.where(take[:, None], staged.rows, live.rows))

    def pending_floor(self, table: str) -> int:
        """The version below which the merge's sweep removes ``table``'s rows (0: no sweep).

        The newest snapshot of the generation recorded complete into the staging view and not
        swept yet (what :meth:`Store.merge_staging` sweeps); looked up once per table.
        """
        if table not in self._floors:
            floor = 0
            for m in self._snapshots:
                if table not in m.tables:
                    continue
                rec = self.store.registry.snapshot(self.run, self.generation, m.seq, table)
                if rec is not None and rec.staging_generation and rec.swept_at is None:
                    floor = max(floor, int(rec.version))
            self._floors[table] = floor
        return self._floors[table]

    def drop_staged_deletes(self, table: str, exp: ExpectedBatch, got: StoreBatch) -> None:
        """Hide live rows that the staging view deletes when merged (in place).

        A staged delete (``op = 1``) is not readable through :meth:`Store.read`; the expected
        record says the generation deleted the key, and the store's progress marks say the
        dump's staging writes are complete, so after the merge the live row is gone.
        """
        if not self.staged(table):
            return
        ev = exp.versions
        pending = ~exp.present & got.found & (got.versions < ev) & (ev >= 0)
        for i in np.nonzero(pending)[0]:
            generation, seq = split_version(int(ev[i]))
            if generation == self.generation and (seq, table) in self._staged_complete():
                got.found[i] = False

    def _staged_complete(self) -> set[tuple[int, str]]:
        if self._complete is None:
            done: dict[tuple[int, str], int] = {}
            for m in self.store.registry.progress(self.run, self.generation):
                if m.complete and m.staging_generation == self.generation:
                    done[(m.seq, m.table)] = done.get((m.seq, m.table), 0) + 1
            self._complete = {k for k, n in done.items() if n >= self._shards.get(k, 1)}
        return self._complete

    def _read(self, table: str, keys: np.ndarray, staging: int | None) -> StoreBatch:
        if staging is None:
            r = self.store.read(table, keys)
        else:
            r = self.store.read(table, keys, staging_generation=staging)
        return StoreBatch(
            np.asarray(r.found, bool), np.asarray(r.versions, np.int64), np.asarray(r.embedding)
        )


class LaterDeletes:
    """Which keys a dump newer than the point deleted (read lazily, only if a key is missing).

    The store keeps no readable trace of a delete, so a key that a later dump evicted reads as
    absent; against an older point it is SUPERSEDED (deleted by a newer version), not MISSING.
    """

    def __init__(self, root: ArtifactRoot, run: str, point: int) -> None:
        self.root, self.run, self.point = root, run, point
        self._records: dict[str, NewerRecords] | None = None

    def mask(self, table: str, keys: np.ndarray) -> np.ndarray:
        """Which of ``keys`` of ``table`` a dump newer than the point deleted."""
        if self._records is None:
            self._records = newer_records(self.root, self.run, self.point)
        records = self._records.get(table)
        return records.deleted(keys) if records is not None else np.zeros(len(keys), bool)

    def wrote_at(self, table: str, keys: np.ndarray, versions: np.ndarray) -> np.ndarray:
        """Which of ``keys`` a dump newer than the point wrote at exactly ``versions``."""
        if self._records is None:
            self._records = newer_records(self.root, self.run, self.point)
        records = self._records.get(table)
        if records is None:
            return np.zeros(len(keys), bool)
        return records.wrote_at(keys, versions)

    def written(self, table: str, keys: np.ndarray, but: frozenset[int]) -> np.ndarray:
        """Which of ``keys`` a dump newer than the point wrote.

        Keys last written by ``but``'s generations (the rollbacks to this point) do not count.
        """
        if self._records is None:
            self._records = newer_records(self.root, self.run, self.point)
        records = self._records.get(table)
        return records.written(keys, but) if records is not None else np.zeros(len(keys), bool)


__all__ = ["LaterDeletes", "Reader"]
