"""Small plain-torch tables driven by hand, for single-process dumper tests and benchmarks."""

from __future__ import annotations

import numpy as np
import torch

from deltarec.artifacts import ArtifactRoot, DType, TableKind, TableSpec, codec, read_shard
from deltarec.tracking.plain import RowShardSource
from deltarec.tracking.tracker import ManualTracker, TrackerHub


class HandTables:
    """Two row-block tables (one with a row offset) whose lookups are recorded by hand."""

    def __init__(self, seed: int = 0, rows: int = 500, dim: int = 8) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.weights = {
            "sparse.a": torch.randn(rows, dim, generator=gen),
            "sparse.b": torch.randn(rows // 2, 4, generator=gen),
        }
        self.offsets = {"sparse.a": 0, "sparse.b": 1000}
        self.tracker = ManualTracker()
        self.hub = TrackerHub(self.tracker, set(self.weights))
        self.rng = np.random.default_rng(seed)
        self.touched: dict[str, set[int]] = {t: set() for t in self.weights}

    def sources(self) -> list[RowShardSource]:
        out = []
        for t, w in self.weights.items():
            spec = TableSpec(
                dim=w.shape[1], kind=TableKind.PLAIN, num_embeddings=w.shape[0], sharding="row_wise"
            )
            out.append(RowShardSource(t, spec, self.hub, t, w, self.offsets[t]))
        return out

    def step(self, step: int, n: int = 20, record: bool = True) -> None:
        """Look up ``n`` random rows per table and change exactly those rows."""
        for t, w in self.weights.items():
            ids = torch.from_numpy(self.rng.integers(0, w.shape[0], size=n))
            if record:
                self.tracker.record(t, ids)
                self.touched[t].update(int(i) + self.offsets[t] for i in ids)
            w[ids] += 0.01 * step

    def rows_of(self, table: str, keys: np.ndarray) -> np.ndarray:
        return self.weights[table][torch.from_numpy(keys - self.offsets[table])].numpy()

    def take_touched(self) -> dict[str, set[int]]:
        out, self.touched = self.touched, {t: set() for t in self.weights}
        return out


def read_dump(root: ArtifactRoot, run: str, gen: int, seq: int) -> dict[str, tuple]:
    """``{table: (keys, decoded rows, ops, steps)}`` of a committed dump (sha256 checked)."""
    m = root.read_manifest(run, gen, seq)
    info = root.read_generation(run, gen)
    out = {}
    for table in m.tables:
        spec = info.tables[table]
        ddir = root.dump_dir(run, gen, seq)
        parts = [read_shard(root, ddir, s, spec.dtype) for s in m.shards_of(table)]
        if not parts:
            out[table] = (np.empty(0, np.int64), np.empty((0, spec.dim)), np.empty(0), np.empty(0))
            continue
        keys = np.concatenate([p.keys for p in parts])
        rows = codec.decode(np.concatenate([p.embedding for p in parts]), spec.dtype, spec.dim)
        ops = np.concatenate([p.ops for p in parts])
        steps = np.concatenate([p.steps for p in parts])
        out[table] = (keys, rows, ops, steps)
    return out


def assert_rows(table: str, dtype: DType, got: np.ndarray, want: np.ndarray) -> None:
    tol = codec.tolerance(dtype, want)
    err = np.abs(got - want).max(axis=1) if len(want) else np.zeros(0)
    assert (err <= tol + 1e-7).all(), f"{table}: rows differ by up to {err.max()}"
