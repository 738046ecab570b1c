"""The rows every store pair is measured on: N distinct random int64 keys, dim D float32 values.

Both sides of a pair read the same rows: deltarec from a committed generation written here with
:func:`deltarec.artifacts.write_dump` (one snapshot dump, 2 ranks' shards, keys in random
order), Feast from the same arrays saved beside it (``rows.npz``), so no side pays for the
other's generation. The update phase is a delta dump of every key again with new values.

Runs in deltarec's virtual environment (it imports deltarec); the Feast side only reads
``rows.npz`` with numpy.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

from deltarec.artifacts import (
    ArtifactRoot,
    DType,
    DumpKind,
    GenerationInfo,
    ShardRows,
    TableSpec,
    write_dump,
)

TABLE = "sparse.ebc.item_id"
RUN = "peer"
CHUNK = 65536
KEY_SPACE = 1 << 40


def random_rows(rows: int, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` distinct random keys in ``[0, 2**40)`` in random order, and their values."""
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(0, KEY_SPACE, int(rows * 1.01) + 16, dtype=np.int64))
    keys = rng.permutation(keys)[:rows]
    if len(keys) < rows:
        raise ValueError(f"drew only {len(keys)} distinct keys of {rows}")
    return keys, rng.standard_normal((rows, dim), dtype=np.float32)


def _chunks(keys: np.ndarray, values: np.ndarray, step: int) -> Iterator[ShardRows]:
    for lo in range(0, len(keys), CHUNK):
        k = keys[lo : lo + CHUNK]
        n = len(k)
        yield ShardRows(k, values[lo : lo + CHUNK], np.zeros(n, np.int8), np.full(n, step))


def build(workdir: str, rows: int, dim: int) -> str:
    """Write the snapshot of generation 1 of run ``peer`` and ``rows.npz`` (keys, values,
    update values) under ``workdir``; returns the artifact root's path."""
    art = os.path.join(workdir, "art")
    root = ArtifactRoot(art)
    keys, values = random_rows(rows, dim, seed=0)
    _, update = random_rows(rows, dim, seed=1)
    np.savez(os.path.join(workdir, "rows.npz"), keys=keys, values=values, update=update)
    spec = TableSpec(dim=dim, dtype=DType.FLOAT32, num_embeddings=rows, sharding="row_wise")
    info = root.allocate_generation(GenerationInfo(RUN, 1, 2, {TABLE: spec}))
    _write(root, info, 0, keys, values)
    return art


def write_update(workdir: str) -> None:
    """Write delta dump 1: every key of the snapshot again, with the update values."""
    root = ArtifactRoot(os.path.join(workdir, "art"))
    data = np.load(os.path.join(workdir, "rows.npz"))
    _write(root, root.read_generation(RUN, 1), 1, data["keys"], data["update"])


def _write(root: ArtifactRoot, info: GenerationInfo, seq: int, keys, values) -> None:
    half = len(keys) // 2
    ranks = {
        0: _chunks(keys[:half], values[:half], seq),
        1: _chunks(keys[half:], values[half:], seq),
    }
    kind = DumpKind.SNAPSHOT if seq == 0 else DumpKind.DELTA
    write_dump(root, info, seq, kind, {TABLE: ranks}, seq, seq, fsync=False)
