import json
import multiprocessing as mp

import numpy as np
import pytest
from tests._helpers.artifacts import TABLE, new_keyed_generation, write_keyed_dump

from deltarec.artifacts import (
    ArtifactRoot,
    DType,
    GenerationInfo,
    Manifest,
    TableSpec,
    check_shard,
    codec,
    read_shard,
)
from deltarec.errors import (
    ArtifactError,
    ChecksumError,
    InvalidIdentifierError,
    SchemaVersionError,
)
from deltarec.ids import make_version, split_version, table_id


def test_version_orders_generations_before_seqs():
    assert make_version(2, 3) == 8589934595
    assert split_version(make_version(7, 12)) == (7, 12)
    assert make_version(1, 2**32 - 1) < make_version(2, 0)
    with pytest.raises(ValueError):
        make_version(0, 1)


def test_table_id_strips_wrapper_prefixes_only_at_the_front():
    assert table_id("module.sparse.ebc", "user_id") == "sparse.ebc.user_id"
    assert table_id("_dmp_wrapped_module.sparse.module", "t") == "sparse.module.t"
    with pytest.raises(InvalidIdentifierError, match="table id"):
        table_id("sparse", "bad name")


@pytest.mark.parametrize("dtype", list(DType))
def test_codec_round_trips_within_the_dtype_tolerance(dtype):
    rng = np.random.default_rng(0)
    values = rng.normal(size=(100, 16)).astype(np.float32)
    values[0] = 0.25  # a constant row quantizes exactly
    enc = codec.encode(values, dtype)
    assert enc.shape == (100, codec.encoded_width(dtype, 16))
    assert enc.nbytes == 100 * codec.row_bytes(dtype, 16)
    dec = codec.decode(enc, dtype, 16)
    err = np.abs(dec - values).max(axis=1)
    assert (err <= codec.tolerance(dtype, values)).all()
    if dtype is DType.FLOAT32:
        assert np.array_equal(dec, values)


def test_shard_round_trip_and_tamper_detection(tmp_path):
    root = ArtifactRoot(str(tmp_path))
    g = new_keyed_generation(root, "run")
    m = write_keyed_dump(root, "run", g, 1, [5, 3, 9], step=7)
    dump_dir = root.dump_dir("run", g, 1)
    rows = read_shard(root, dump_dir, m.shards[0], DType.FLOAT32)
    assert rows.keys.tolist() == [5, 3, 9]
    assert rows.steps.tolist() == [7, 7, 7]
    assert root.read_manifest("run", g, 1).to_json() == m.to_json()
    path = tmp_path / "run" / "gen-000001" / "dump-000001" / TABLE / "rank-00000.parquet"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=r"rank-00000\.parquet"):
        check_shard(root, dump_dir, m.shards[0])


def test_unknown_schema_version_is_rejected_with_the_path(tmp_path):
    root = ArtifactRoot(str(tmp_path))
    g = new_keyed_generation(root, "run")
    write_keyed_dump(root, "run", g, 0, [1], step=0)
    mpath = tmp_path / "run" / "gen-000001" / "dump-000000" / "MANIFEST.json"
    obj = json.loads(mpath.read_text())
    obj["schema_version"] = 99
    mpath.write_text(json.dumps(obj))
    with pytest.raises(SchemaVersionError, match=r"MANIFEST\.json.*schema_version 99"):
        root.read_manifest("run", g, 0)


def test_manifest_with_a_wrong_version_field_is_rejected(tmp_path):
    root = ArtifactRoot(str(tmp_path))
    g = new_keyed_generation(root, "run")
    m = write_keyed_dump(root, "run", g, 2, [1], step=0)
    obj = m.to_json()
    obj["version"] = 5
    with pytest.raises(ArtifactError, match="version 5"):
        Manifest.from_json(obj, "x/MANIFEST.json")


def test_incomplete_dumps_are_ignored_and_cleaned(tmp_path):
    root = ArtifactRoot(str(tmp_path))
    g = new_keyed_generation(root, "run")
    write_keyed_dump(root, "run", g, 0, [1], step=0)
    write_keyed_dump(root, "run", g, 1, [2], step=5, commit=False)
    assert root.list_dumps("run", g) == [0]
    assert root.list_incomplete_dumps("run", g) == [1]
    removed = root.clean_incomplete("run")
    assert [r.rsplit("/", 1)[-1] for r in removed] == ["dump-000001"]
    assert root.list_incomplete_dumps("run", g) == []
    assert root.list_dumps("run", g) == [0]


def _claim(path: str, out) -> None:
    info = GenerationInfo(run="r", generation=1, world_size=1, tables={TABLE: TableSpec(dim=4)})
    out.put(ArtifactRoot(path).allocate_generation(info).generation)


def test_concurrent_allocations_never_share_a_generation(tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_claim, args=(str(tmp_path), q)) for _ in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    got = sorted(q.get(timeout=5) for _ in procs)
    assert got == [1, 2, 3, 4, 5, 6]
    assert ArtifactRoot(str(tmp_path)).list_generations("r") == got
