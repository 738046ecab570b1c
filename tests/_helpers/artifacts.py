"""Write small generations directly with the artifacts API (no torch), on one rank.

* :func:`new_keyed_generation` and :func:`write_keyed_dump`: one table whose row of a key at a
  step is :func:`row_for` (the key and step read back from the row).
* :class:`Lineage`: two tables (a plain one and a ZCH one, ``SPECS``) whose rows are
  :func:`values` of a salt, and the real publisher, so what reads them (verify, promote, the
  serving replica) meets what a trainer's outbox holds.
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from deltarec import artifacts
from deltarec.artifacts import (
    ArtifactRoot,
    DType,
    DumpKind,
    GenerationInfo,
    Manifest,
    Parent,
    ShardRows,
    TableKind,
    TableSpec,
    codec,
)
from deltarec.publish import DumpPublisher
from deltarec.publish.types import PublishMode
from deltarec.stores.base import Store

TABLE = "sparse.ebc.t"
DIM = 4


def new_keyed_generation(root: ArtifactRoot, run: str, parent: Parent | None = None) -> int:
    """Allocate a generation of ``run`` with the one table (1 rank); its number."""
    info = GenerationInfo(
        run=run, generation=1, world_size=1, tables={TABLE: TableSpec(dim=DIM)}, parent=parent
    )
    return root.allocate_generation(info).generation


def row_for(key: int, step: int) -> np.ndarray:
    return np.full(DIM, key * 1000 + step, dtype=np.float32)


def write_keyed_dump(
    root: ArtifactRoot,
    run: str,
    generation: int,
    seq: int,
    keys: list[int],
    step: int,
    kind: DumpKind = DumpKind.DELTA,
    evicted: tuple[int, ...] = (),
    commit: bool = True,
) -> Manifest:
    """Commit dump ``seq`` of ``keys`` (each row :func:`row_for` its key and ``step``; the
    ``evicted`` ones as ``op = 1``) through :func:`deltarec.artifacts.write_dump`."""
    k = np.asarray(keys, dtype=np.int64)
    floats = np.stack([row_for(int(x), step) for x in k]) if len(k) else np.zeros((0, DIM))
    ops = np.asarray([1 if int(x) in evicted else 0 for x in k], dtype=np.int8)
    rows = ShardRows(k, codec.encode(floats, DType.FLOAT32), ops, np.full(len(k), step))
    info = root.read_generation(run, generation)
    return artifacts.write_dump(
        root, info, seq, kind, {TABLE: {0: rows}}, step, step, commit=commit
    )


RUN = "ctr"
T_EMB = "sparse.ebc.user_id"
T_ZCH = "sparse.zch.ad_id"
SPECS = {
    T_EMB: TableSpec(dim=8, dtype=DType.FLOAT32, kind=TableKind.PLAIN, num_embeddings=1000),
    T_ZCH: TableSpec(dim=4, dtype=DType.INT8_ROWWISE, kind=TableKind.ZCH, zch_size=64),
}

ZCH_KEYS = np.array([-1, 3, 7, 11, 19], np.int64)
"""The ZCH ids of :meth:`Lineage.first_generation`'s snapshot unless told."""

Rows = tuple[np.ndarray, float] | tuple[np.ndarray, float, np.ndarray]
"""A table's rows in a dump: ``(keys, salt[, ops])``; values from :func:`values`."""


def sqlite_url_in(tmp: str | os.PathLike[str]) -> str:
    """The URL of a SQLite store in file ``store.db`` under folder ``tmp``."""
    return f"sqlite:///{pathlib.Path(tmp) / 'store.db'}"


def values(keys: np.ndarray, salt: float, dim: int) -> np.ndarray:
    """Deterministic float rows: distinct per key and per salt."""
    k = np.asarray(keys, np.float32)[:, None]
    return (np.sin(k * 0.37 + salt + np.arange(dim, dtype=np.float32)) * 2.0).astype(np.float32)


_L = TypeVar("_L", bound="Lineage")


@dataclass
class Lineage:
    """The generations of one run under ``root``; ``step`` is the last dump's training step."""

    root: ArtifactRoot
    run: str = RUN
    specs: dict[str, TableSpec] = field(default_factory=lambda: dict(SPECS))
    step: int = 0
    T_EMB = T_EMB
    T_ZCH = T_ZCH

    @classmethod
    def under(cls: type[_L], tmp: str | os.PathLike[str]) -> _L:
        """A lineage of the run in a fresh artifact root ``artifacts`` under folder ``tmp``."""
        return cls(ArtifactRoot(str(pathlib.Path(tmp) / "artifacts")))

    @staticmethod
    def values(keys: np.ndarray, salt: float, dim: int) -> np.ndarray:
        return values(keys, salt, dim)

    @staticmethod
    def flip_byte(path: str) -> None:
        """Corrupt one byte in the middle of a file (a shard's data pages)."""
        data = bytearray(pathlib.Path(path).read_bytes())
        data[len(data) // 3] ^= 0xFF
        pathlib.Path(path).write_bytes(bytes(data))

    def expected_row(self, table: str, keys: np.ndarray, salt: float) -> np.ndarray:
        """The encoded rows of ``keys`` written with ``salt`` (what the store must hold)."""
        spec = self.specs[table]
        return codec.encode(values(np.asarray(keys), salt, spec.dim), spec.dtype)

    def generation(self, parent: Parent | None = None) -> int:
        """Allocate the next generation of the run (1 rank, ``specs``); its number."""
        info = GenerationInfo(self.run, 1, 1, dict(self.specs), parent=parent)
        return self.root.allocate_generation(info).generation

    def first_generation(
        self,
        keys: np.ndarray | None = None,
        updated: np.ndarray | None = None,
        zch_keys: np.ndarray | None = None,
    ) -> int:
        """A generation of a snapshot (emb ``keys``, 0..99, and ``zch_keys``, ``ZCH_KEYS``, salt
        0) then a delta (emb ``updated``, 0..9, and ZCH id -1, salt 1; ZCH id 7 evicted)."""
        g = self.generation()
        snapshot = {
            T_EMB: (np.arange(100) if keys is None else keys, 0.0),
            T_ZCH: (ZCH_KEYS if zch_keys is None else zch_keys, 0.0),
        }
        self.dump(g, 0, snapshot, kind=DumpKind.SNAPSHOT)
        delta = {
            T_EMB: (np.arange(10) if updated is None else updated, 1.0),
            T_ZCH: (np.array([-1, 7]), 1.0, np.array([0, 1])),
        }
        self.dump(g, 1, delta)
        return g

    def dump(
        self,
        gen: int,
        seq: int,
        rows: dict[str, Rows],
        kind: DumpKind = DumpKind.DELTA,
        steps: int = 10,
        extra: dict | None = None,
    ) -> Manifest:
        """Commit one dump ``steps`` training steps after the last, of ``rows`` per table."""
        first = self.step + 1
        self.step += steps
        shards = {}
        for table, spec_rows in sorted(rows.items()):
            keys = np.asarray(spec_rows[0], np.int64)
            ops = np.asarray(spec_rows[2] if len(spec_rows) == 3 else np.zeros(len(keys)), np.int8)
            enc = self.expected_row(table, keys, spec_rows[1])
            shards[table] = {0: ShardRows(keys, enc, ops, np.full(len(keys), self.step, np.int64))}
        info = self.root.read_generation(self.run, gen)
        return artifacts.write_dump(
            self.root, info, seq, kind, shards, first, self.step, extra=extra
        )

    def publish(
        self, store: Store, gen: int, seqs: list[int] | None = None, staged: bool = False
    ) -> None:
        """Publish committed dumps of ``gen`` with the publisher (direct or staged mode)."""
        mode = PublishMode.STAGED if staged else PublishMode.DIRECT
        publisher = DumpPublisher(store, self.root, self.run, mode=mode)
        for seq in seqs if seqs is not None else self.root.list_dumps(self.run, gen):
            publisher.publish_dump(self.root.read_manifest(self.run, gen, seq), 0)
