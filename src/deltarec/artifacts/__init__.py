"""Generation artifacts, the outbox between training and stores (SPEC §3).

Layout, JSON records, row encoding and parquet shards on any fsspec URI. This package never
imports torch: publishers, verifiers and other writers use it without the training stack.

Exports:
    ArtifactRoot: paths, atomic writes, generation allocation, listing, manifests.
    ShardWriter, ShardPlace, ShardRows, iter_shard, read_shard, check_shard: parquet shards.
    write_dump: commit a dump written by one process (shards first, manifest last).
    GenerationInfo, Manifest, ShardInfo, TableSpec, Parent: the JSON records.
    DType, TableKind, DumpKind, Op, FALLBACK_KEY: enums and constants.
    codec: row encoding shared by shards and stores.
"""

from deltarec.artifacts import codec
from deltarec.artifacts.root import ArtifactRoot, dump_name, gen_name, shard_relpath
from deltarec.artifacts.shards import (
    ShardPlace,
    ShardRows,
    ShardWriter,
    check_shard,
    iter_shard,
    read_shard,
)
from deltarec.artifacts.types import (
    FALLBACK_KEY,
    DType,
    DumpKind,
    GenerationInfo,
    Manifest,
    Op,
    Parent,
    ShardInfo,
    TableKind,
    TableSpec,
    parse_time,
    utc_now,
)
from deltarec.artifacts.writer import write_dump

__all__ = [
    "FALLBACK_KEY",
    "ArtifactRoot",
    "DType",
    "DumpKind",
    "GenerationInfo",
    "Manifest",
    "Op",
    "Parent",
    "ShardInfo",
    "ShardPlace",
    "ShardRows",
    "ShardWriter",
    "TableKind",
    "TableSpec",
    "check_shard",
    "codec",
    "dump_name",
    "gen_name",
    "iter_shard",
    "parse_time",
    "read_shard",
    "shard_relpath",
    "utc_now",
    "write_dump",
]
