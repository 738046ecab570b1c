"""Write small generations directly with the artifacts API (no torch): one table, one rank."""

from __future__ import annotations

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
    TableSpec,
    codec,
)

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
    values = np.stack([row_for(int(x), step) for x in k]) if len(k) else np.zeros((0, DIM))
    ops = np.asarray([1 if int(x) in evicted else 0 for x in k], dtype=np.int8)
    rows = ShardRows(k, codec.encode(values, DType.FLOAT32), ops, np.full(len(k), step))
    info = root.read_generation(run, generation)
    return artifacts.write_dump(
        root, info, seq, kind, {TABLE: {0: rows}}, step, step, commit=commit
    )
