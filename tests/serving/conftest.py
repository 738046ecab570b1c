"""Fixtures of the replica tests: generations written with the artifacts API, a SQLite store.

``Outbox`` commits dumps through :func:`deltarec.artifacts.write_dump` (shards, then the
manifest last) and publishes them with the real publisher, so the replica follows what a
trainer's outbox holds and promote/rollback run against a real store.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

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
    write_dump,
)
from deltarec.publish import DumpPublisher
from deltarec.stores import open_store
from deltarec.stores.base import Store

RUN = "ctr"
T_EMB = "sparse.ebc.user_id"
T_ZCH = "sparse.zch.ad_id"
SPECS = {
    T_EMB: TableSpec(dim=8, dtype=DType.FLOAT32, kind=TableKind.PLAIN, num_embeddings=1000),
    T_ZCH: TableSpec(dim=4, dtype=DType.INT8_ROWWISE, kind=TableKind.ZCH, zch_size=64),
}


def values(keys: np.ndarray, salt: float, dim: int) -> np.ndarray:
    """Deterministic float rows: distinct per key and per salt."""
    k = np.asarray(keys, np.float32)[:, None]
    return (np.sin(k * 0.37 + salt + np.arange(dim, dtype=np.float32)) * 2.0).astype(np.float32)


@dataclass
class Outbox:
    root: ArtifactRoot
    run: str = RUN
    specs: dict[str, TableSpec] = field(default_factory=lambda: dict(SPECS))
    step: int = 0

    def encoded(self, table: str, keys: np.ndarray, salt: float) -> np.ndarray:
        spec = self.specs[table]
        return codec.encode(values(np.asarray(keys), salt, spec.dim), spec.dtype)

    def generation(self, parent: Parent | None = None) -> int:
        info = GenerationInfo(self.run, 1, 1, dict(self.specs), parent=parent)
        return self.root.allocate_generation(info).generation

    def dump(
        self,
        gen: int,
        seq: int,
        rows: dict[str, tuple],
        kind: DumpKind = DumpKind.DELTA,
        extra: dict | None = None,
    ) -> Manifest:
        """Commit one dump: per table ``(keys, salt[, ops])``."""
        first = self.step + 1
        self.step += 10
        shards = {}
        for table, spec_rows in sorted(rows.items()):
            keys = np.asarray(spec_rows[0], np.int64)
            ops = np.asarray(spec_rows[2] if len(spec_rows) == 3 else np.zeros(len(keys)), np.int8)
            enc = self.encoded(table, keys, spec_rows[1])
            shards[table] = {0: ShardRows(keys, enc, ops, np.full(len(keys), self.step, np.int64))}
        info = self.root.read_generation(self.run, gen)
        return write_dump(self.root, info, seq, kind, shards, first, self.step, extra=extra)

    def publish(self, store: Store, gen: int) -> None:
        publisher = DumpPublisher(store, self.root, self.run)
        for seq in self.root.list_dumps(self.run, gen):
            publisher.publish_dump(self.root.read_manifest(self.run, gen, seq), 0)

    def first_generation(self) -> int:
        """Generation 1: a snapshot of emb keys 0..49 and ZCH ids, then a delta."""
        g = self.generation()
        self.dump(
            g,
            0,
            {T_EMB: (np.arange(50), 0.0), T_ZCH: (np.array([-1, 3, 7, 11]), 0.0)},
            kind=DumpKind.SNAPSHOT,
        )
        self.dump(g, 1, {T_EMB: (np.arange(10), 1.0), T_ZCH: (np.array([-1, 7]), 1.0, [0, 1])})
        return g


@pytest.fixture
def outbox(tmp_path) -> Outbox:
    return Outbox(ArtifactRoot(str(tmp_path / "artifacts")))


@pytest.fixture
def store_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'store.db'}"


@pytest.fixture
def store(store_url, outbox):
    with open_store(store_url, outbox.root.uri, run=RUN) as s:
        yield s
