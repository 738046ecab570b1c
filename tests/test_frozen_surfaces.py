"""Freeze the artifact schema: renaming or dropping a field breaks every other writer/reader.

The command line (command names, every flag) is frozen in tests/cli/test_cli_surface.py."""

import pyarrow as pa
from tests._helpers.artifacts import TABLE, new_keyed_generation, write_keyed_dump

from deltarec.artifacts import ArtifactRoot, DType, codec


def test_generation_json_fields_are_frozen(tmp_path):
    root = ArtifactRoot(str(tmp_path))
    g = new_keyed_generation(root, "run")
    obj = root.read_json(root.generation_file("run", g))
    assert set(obj) == {
        "schema_version",
        "run",
        "generation",
        "created_at",
        "parent",
        "world_size",
        "tables",
    }
    assert set(obj["tables"][TABLE]) == {
        "dim",
        "dtype",
        "kind",
        "num_embeddings",
        "zch_size",
        "sharding",
    }


def test_manifest_json_fields_are_frozen(tmp_path):
    root = ArtifactRoot(str(tmp_path))
    g = new_keyed_generation(root, "run")
    write_keyed_dump(root, "run", g, 3, [1, 2], step=9)
    obj = root.read_json(root.manifest_file("run", g, 3))
    assert list(obj) == [
        "schema_version",
        "run",
        "generation",
        "seq",
        "version",
        "kind",
        "first_step",
        "last_step",
        "created_at",
        "world_size",
        "shards",
        "tables",
    ]
    assert list(obj["shards"][0]) == ["path", "table", "rank", "rows", "bytes", "sha256"]
    assert obj["shards"][0]["path"] == f"{TABLE}/rank-00000.parquet"
    assert obj["tables"] == {TABLE: {"rows": 2}}


def test_parquet_columns_are_frozen():
    schema = codec.shard_schema(DType.INT8_ROWWISE, 8)
    assert schema.names == ["key", "embedding", "op", "step"]
    assert schema.field("key").type == pa.int64()
    emb = schema.field("embedding").type
    assert (emb.list_size, emb.value_type) == (12, pa.uint8())
    assert not emb.value_field.nullable  # required values: half the parquet level encoding
    assert schema.field("op").type == pa.int8()
    assert schema.field("step").type == pa.int64()
    emb16 = codec.shard_schema(DType.FLOAT16, 8).field("embedding").type
    assert (emb16.list_size, emb16.value_type) == (8, pa.float16())
