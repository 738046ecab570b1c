"""Committing a dump written by one process: shards first, the manifest last (SPEC §3).

:func:`write_dump` is how every single-process writer (rollback, :mod:`deltarec.testing`, test
fixtures) commits a dump; the multi-rank dump worker builds its manifest with the same
:meth:`~deltarec.artifacts.types.Manifest.from_shards` and commits it from rank 0 once every
rank's shards are closed. The contract:

* every shard is written under a temporary name, made durable (``fsync``) and renamed into
  place before MANIFEST.json is written; MANIFEST.json is itself written atomically, last;
* if any shard fails, nothing is committed: the failing shard's temporary file is removed
  and the dump directory stays without a manifest, which readers ignore and the next
  generation's start cleans up;
* the manifest lists the shards by (table, rank) and each table's rows summed over its
  shards, in the order the caller gave the tables.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from deltarec.artifacts.root import ArtifactRoot
from deltarec.artifacts.shards import ShardPlace, ShardRows, ShardWriter
from deltarec.artifacts.types import DumpKind, GenerationInfo, Manifest, ShardInfo
from deltarec.errors import BadInputError

RankRows = ShardRows | Iterable[ShardRows]
"""One rank's rows of a table: one :class:`ShardRows`, or several (each written as row groups
of ``codec.row_group_rows`` rows at most)."""


def write_dump(
    root: ArtifactRoot,
    info: GenerationInfo,
    seq: int,
    kind: DumpKind,
    rows: Mapping[str, Mapping[int, RankRows]],
    first_step: int,
    last_step: int,
    extra: dict[str, Any] | None = None,
    *,
    fsync: bool = True,
    commit: bool = True,
) -> Manifest:
    """Write dump ``seq`` of ``info``'s generation: every shard, then MANIFEST.json.

    Args:
        root: the artifact root.
        info: the generation (its GENERATION.json is written): run, number, world size and
            the tables' encodings.
        seq: the dump's sequence number.
        kind: snapshot, delta or final.
        rows: ``rows[table][rank]``, encoded as stored; one shard per table and rank.
        first_step: the first training step the dump covers.
        last_step: the last training step the dump covers.
        extra: additional top-level manifest fields (e.g. ``rollback``).
        fsync: make each shard durable before its rename (off only for throwaway roots).
        commit: write MANIFEST.json; False writes only the shards and returns the manifest
            that another writer (standing in for rank 0) commits with
            :meth:`~deltarec.artifacts.root.ArtifactRoot.commit_manifest`.

    Returns:
        The manifest, committed if ``commit``.

    Raises:
        BadInputError: a table not in ``info.tables`` or a rank outside the world size
            (before anything is written).
    """
    for table, by_rank in rows.items():
        if table not in info.tables:
            raise BadInputError(
                f"dump {seq} of run {info.run!r} generation {info.generation}: table "
                f"{table!r} is not in GENERATION.json (tables: {sorted(info.tables)})"
            )
        bad = sorted(r for r in by_rank if not 0 <= r < info.world_size)
        if bad:
            raise BadInputError(
                f"dump {seq} of run {info.run!r} generation {info.generation}: table "
                f"{table!r} has rows for rank(s) {bad}, outside world size {info.world_size}"
            )
    shards: list[ShardInfo] = []
    for table, by_rank in rows.items():
        spec = info.tables[table]
        for rank, parts in sorted(by_rank.items()):
            place = ShardPlace(info.run, info.generation, seq, table, rank)
            with ShardWriter(root, place, spec.dtype, spec.dim, fsync=fsync) as writer:
                for part in [parts] if isinstance(parts, ShardRows) else parts:
                    writer.write(part)
                shards.append(writer.close())
    manifest = Manifest.from_shards(
        info.run,
        info.generation,
        seq,
        kind,
        first_step,
        last_step,
        info.world_size,
        shards,
        tables=rows,
        extra=extra,
    )
    if commit:
        root.commit_manifest(manifest)
    return manifest
