"""Artifact queries about what came after a point: newer dumps' records, rollbacks to it.

Verification of an older point (and rollback to it) must know which keys later dumps touched:
a key that a later dump deleted (``op = 1``) is legitimately absent from the store, and every
key a later dump wrote is one a rollback must restore. Only the ``key`` and ``op`` columns of
the newer dumps are read.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq

from deltarec.artifacts import codec
from deltarec.artifacts.root import ArtifactRoot
from deltarec.artifacts.types import ROLLBACK_FIELD, Op, TableSpec
from deltarec.errors import ArtifactError
from deltarec.ids import split_version


@dataclass(frozen=True)
class NewerRecords:
    """The latest record per key of one table over every dump newer than a point.

    Attributes:
        spec: the table's spec, from the newest generation that wrote it.
        keys: int64, sorted, unique.
        versions: int64, the latest record's version.
        ops: int8, the latest record's op.
        every_key, every_version: int64, every ``(key, version)`` record of the newer dumps,
            sorted by key then version (what :meth:`wrote_at` looks up).
    """

    spec: TableSpec
    keys: np.ndarray
    versions: np.ndarray
    ops: np.ndarray
    every_key: np.ndarray
    every_version: np.ndarray

    def wrote_at(self, keys: np.ndarray, versions: np.ndarray) -> np.ndarray:
        """Bool mask: a newer dump wrote ``keys[i]`` at exactly ``versions[i]``.

        What makes a newer row in the store this run's own (SUPERSEDED): a version that no
        dump of the run wrote for the key is another run's row, or a write outside the lineage.
        """
        keys = np.asarray(keys, np.int64)
        versions = np.asarray(versions, np.int64)
        lo = np.searchsorted(self.every_key, keys, "left")
        hi = np.searchsorted(self.every_key, keys, "right")
        out = np.zeros(keys.shape, bool)
        for i in np.nonzero(hi > lo)[0]:
            span = self.every_version[lo[i] : hi[i]]
            out[i] = bool((span == versions[i]).any())
        return out

    def deleted(self, keys: np.ndarray) -> np.ndarray:
        """Bool mask: the latest newer record of the key is a delete (``op = 1``)."""
        keys = np.asarray(keys, np.int64)
        if len(self.keys) == 0:
            return np.zeros(keys.shape, bool)
        pos = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
        return (self.keys[pos] == keys) & (self.ops[pos] == Op.EVICTED)

    def written(self, keys: np.ndarray, but: frozenset[int] = frozenset()) -> np.ndarray:
        """Bool mask: a newer dump wrote the key.

        A key whose latest newer record belongs to one of ``but``'s generations does not count.
        """
        keys = np.asarray(keys, np.int64)
        if len(self.keys) == 0:
            return np.zeros(keys.shape, bool)
        pos = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
        hit = self.keys[pos] == keys
        for i in np.nonzero(hit)[0]:
            if split_version(int(self.versions[pos[i]]))[0] in but:
                hit[i] = False
        return hit


def newer_records(root: ArtifactRoot, run: str, point: int) -> dict[str, NewerRecords]:
    """Per table, the latest record of each key written by a dump newer than ``point``.

    Every committed dump of ``run`` at a version above ``point`` counts: later dumps of the
    point's generation, newer generations, siblings, rollbacks.

    Raises:
        ArtifactError: a shard is missing or unreadable, or a table has no spec.
    """
    parts: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    specs: dict[str, TableSpec] = {}
    for gen in root.list_generations(run):
        if gen < split_version(point)[0]:
            continue
        tables = root.read_generation(run, gen).tables
        for seq in root.list_dumps(run, gen):
            m = root.read_manifest(run, gen, seq)
            if m.version <= point:
                continue
            dump_dir = root.dump_dir(run, gen, seq)
            for shard in m.shards:
                keys, ops = _keys_ops(root, dump_dir, shard.path)
                versions = np.full(len(keys), m.version, np.int64)
                parts.setdefault(shard.table, []).append((keys, versions, ops))
                if shard.table not in tables:
                    raise ArtifactError(
                        root.url(root.generation_file(run, gen)),
                        f"dump {seq} holds table {shard.table!r} that it does not describe",
                    )
                specs[shard.table] = tables[shard.table]
    return {t: _latest(specs[t], p) for t, p in parts.items()}


def _keys_ops(root: ArtifactRoot, dump_dir: str, relpath: str) -> tuple[np.ndarray, np.ndarray]:
    path = posixpath.join(dump_dir, relpath)
    try:
        with root.open_listed(dump_dir, relpath) as f:
            table = pq.read_table(f, columns=[codec.KEY, codec.OP])
    except FileNotFoundError:
        raise ArtifactError(root.url(path), "shard listed in the manifest is missing") from None
    except OSError as e:
        raise ArtifactError(root.url(path), f"unreadable parquet: {e}") from e
    return (
        np.asarray(table.column(codec.KEY).to_numpy(), np.int64),
        np.asarray(table.column(codec.OP).to_numpy(), np.int8),
    )


def _latest(
    spec: TableSpec, parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
) -> NewerRecords:
    keys, versions, ops = (np.concatenate(c) for c in zip(*parts, strict=True))
    order = np.lexsort((versions, keys))
    keys, versions, ops = keys[order], versions[order], ops[order]
    last = np.ones(len(keys), bool)
    last[:-1] = keys[1:] != keys[:-1]
    return NewerRecords(spec, keys[last], versions[last], ops[last], keys, versions)


def rollback_generations(
    root: ArtifactRoot, run: str, generation: int, through_seq: int | None
) -> frozenset[int]:
    """Generations of ``run`` that are rollbacks to exactly ``generation`` through ``through_seq``.

    A rollback generation's GENERATION.json carries ``"rollback": {"to_generation": G,
    "through_seq": S}``; its rows restore the values G had at S under a newer version.
    """
    found: set[int] = set()
    for g in root.list_generations(run):
        if g == generation:
            continue
        target = root.read_generation(run, g).extra.get(ROLLBACK_FIELD)
        if not isinstance(target, dict):
            continue
        if target.get("to_generation") == generation and target.get("through_seq") == through_seq:
            found.add(g)
    return frozenset(found)
