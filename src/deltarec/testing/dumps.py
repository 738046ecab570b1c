"""Write generation artifacts directly (no training) for tests and benchmarks of the readers.

Builds GENERATION.json, parquet shards (in bounded row groups) and MANIFEST.json exactly as
SPEC §3 describes them, through :func:`deltarec.artifacts.write_dump` (shards first, the
manifest last), so publishers, verifiers and benchmarks can be exercised without torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from deltarec import artifacts
from deltarec.artifacts import ArtifactRoot, ShardRows, codec
from deltarec.artifacts.types import DumpKind, GenerationInfo, Manifest, Parent, TableSpec


def new_generation(
    root: ArtifactRoot,
    run: str,
    tables: Mapping[str, TableSpec],
    world_size: int,
    parent: Parent | None = None,
) -> GenerationInfo:
    """Allocate the next generation of ``run`` with these tables."""
    info = GenerationInfo(
        run=run, generation=1, world_size=world_size, tables=dict(tables), parent=parent
    )
    return root.allocate_generation(info)


def random_rows(
    keys: Iterable[int] | np.ndarray,
    spec: TableSpec,
    seed: int = 0,
    ops: np.ndarray | None = None,
    step: int = 1,
) -> ShardRows:
    """Encoded rows of random values for ``keys`` (ops 0 unless given)."""
    k = np.asarray(list(keys) if not isinstance(keys, np.ndarray) else keys, dtype=np.int64)
    values = np.random.default_rng(seed).standard_normal((k.shape[0], spec.dim), np.float32)
    return ShardRows(
        keys=k,
        embedding=codec.encode(values, spec.dtype),
        ops=np.zeros(k.shape[0], np.int8) if ops is None else np.asarray(ops, np.int8),
        steps=np.full(k.shape[0], step, np.int64),
    )


def write_dump(
    root: ArtifactRoot,
    info: GenerationInfo,
    seq: int,
    rows: Mapping[str, Mapping[int, ShardRows | Iterable[ShardRows]]],
    kind: DumpKind = DumpKind.DELTA,
    first_step: int = 1,
    last_step: int = 1,
    commit: bool = True,
) -> Manifest:
    """Write the shards of one dump and, with ``commit``, its manifest (without fsync).

    ``rows[table][rank]`` is a :class:`ShardRows` or an iterable of them (each written as row
    groups of at most ``codec.row_group_rows`` rows).
    Written by :func:`deltarec.artifacts.write_dump`: shards first, the manifest last.

    Returns:
        The manifest (committed only if ``commit``).
    """
    return artifacts.write_dump(
        root, info, seq, kind, rows, first_step, last_step, fsync=False, commit=commit
    )
