"""The artifact side of a verification: shard checksums, and rollbacks to a point.

Every shard a lineage lists is checked against its manifest entry (sha256, size, row count);
a failure names the shard's full path. Rollback generations (GENERATION.json field
:data:`~deltarec.artifacts.types.ROLLBACK_FIELD`) are the generations whose rows restore a
point's values under a newer version, compared by value.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from deltarec.artifacts.lineage import ShardRef
from deltarec.artifacts.root import ArtifactRoot
from deltarec.artifacts.shards import check_shard
from deltarec.artifacts.wholeshard import WHOLE_SHARD_BYTES, CheckedShards, checked_bytes
from deltarec.errors import ArtifactError
from deltarec.ids import split_version
from deltarec.verify.types import ShardFailure


def check_shards(
    root: ArtifactRoot, refs: list[ShardRef], checked: CheckedShards | None = None
) -> tuple[int, list[ShardFailure]]:
    """Check sha256, size and row count of each shard against its manifest entry.

    A shard ``checked`` already read and found to match (the replay read it from its checked
    bytes) counts as checked without being read again.

    Returns:
        ``(shards checked, failures)``; a failure names the shard's full path.
    """
    failures: list[ShardFailure] = []
    for ref in refs:
        if checked is not None and checked.checked(ref.dump_dir, ref.shard):
            continue
        problem = _shard_problem(root, ref)
        if problem is not None:
            gen, seq = split_version(ref.version)
            path = root.url(f"{ref.dump_dir}/{ref.shard.path}")
            failures.append(ShardFailure(path, ref.shard.table, ref.shard.rank, gen, seq, problem))
    return len(refs), failures


def _shard_problem(root: ArtifactRoot, ref: ShardRef) -> str | None:
    """What is wrong with one shard (sha256 and size, then its row count), or None.

    A small shard is read once: its footer is parsed from the bytes just checked (a dump of
    hundreds of ranks has thousands of shards, and each open costs more than its bytes).
    """
    small = ref.shard.bytes <= WHOLE_SHARD_BYTES
    try:
        data = checked_bytes(root, ref.dump_dir, ref.shard) if small else None
        if data is None:
            check_shard(root, ref.dump_dir, ref.shard)
    except ArtifactError as e:
        return e.problem
    try:
        if data is not None:
            rows = pq.ParquetFile(pa.BufferReader(data), pre_buffer=False).metadata.num_rows
        else:
            with root.open_listed(ref.dump_dir, ref.shard.path) as f:
                rows = pq.ParquetFile(f).metadata.num_rows
    except Exception as e:  # any parquet failure is this shard's problem
        return f"unreadable parquet: {e}"
    if rows != ref.shard.rows:
        return f"holds {rows} rows, the manifest says {ref.shard.rows}"
    return None


def lineage_shard_refs(
    root: ArtifactRoot, run: str, generation: int, through_seq: int | None
) -> list[ShardRef]:
    """Every shard of every committed dump of the lineage (ancestors in full), for checksums."""
    refs: list[ShardRef] = []
    for info in root.lineage(run, generation):
        for seq in root.list_dumps(run, info.generation):
            if info.generation == generation and through_seq is not None and seq > through_seq:
                break
            try:
                m = root.read_manifest(run, info.generation, seq)
            except ArtifactError:
                continue  # reported through the expected-state error
            d = root.dump_dir(run, info.generation, seq)
            refs.extend(ShardRef(d, s, m.version) for s in m.shards)
    return refs


__all__ = ["check_shards", "lineage_shard_refs"]
