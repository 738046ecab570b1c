"""write_dump and Manifest.from_shards: a single-process dump commits its shards first, then
its manifest; a failure commits nothing."""

from __future__ import annotations

import numpy as np
import pytest

from deltarec.artifacts import (
    ArtifactRoot,
    DType,
    DumpKind,
    GenerationInfo,
    Manifest,
    ShardInfo,
    ShardRows,
    TableSpec,
    check_shard,
    codec,
    read_shard,
    write_dump,
)
from deltarec.errors import BadInputError

A, B = "sparse.a", "sparse.b"


def _info(root: ArtifactRoot, world_size: int = 2) -> GenerationInfo:
    tables = {A: TableSpec(dim=4), B: TableSpec(dim=8, dtype=DType.FLOAT16)}
    return root.allocate_generation(GenerationInfo("run", 1, world_size, tables))


def _rows(keys, dim: int, dtype: DType = DType.FLOAT32) -> ShardRows:
    k = np.asarray(keys, np.int64)
    values = np.tile(k[:, None].astype(np.float32), (1, dim))
    return ShardRows(k, codec.encode(values, dtype), np.zeros(len(k), np.int8), np.full(len(k), 3))


def _tmp_files(root: ArtifactRoot) -> list[str]:
    return [p for p in root.fs.find(root.path) if "/.tmp-" in p]


def test_a_dump_commits_its_manifest_only_once_every_shard_is_in_place(tmp_path, monkeypatch):
    root = ArtifactRoot(str(tmp_path))
    info = _info(root)
    seen_at_commit = []
    real_commit = ArtifactRoot.commit_manifest

    def commit(self, manifest):
        ddir = self.dump_dir("run", info.generation, 4)
        for shard in manifest.shards:
            check_shard(self, ddir, shard)  # in place, with the listed sha256 and size
        seen_at_commit.append((len(manifest.shards), _tmp_files(self)))
        return real_commit(self, manifest)

    monkeypatch.setattr(ArtifactRoot, "commit_manifest", commit)
    rows = {
        B: {1: _rows([7, 9], 8, DType.FLOAT16), 0: _rows([2], 8, DType.FLOAT16)},
        A: {0: [_rows([1, 3], 4), _rows([5], 4)]},  # two row groups
    }
    m = write_dump(root, info, 4, DumpKind.SNAPSHOT, rows, 11, 20, extra={"note": "x"})
    assert seen_at_commit == [(3, [])]
    assert root.read_manifest("run", info.generation, 4).to_json() == m.to_json()
    assert [(s.table, s.rank, s.rows) for s in m.shards] == [(A, 0, 3), (B, 0, 1), (B, 1, 2)]
    assert m.tables == {B: 3, A: 3}  # in the order given
    assert (m.kind, m.first_step, m.last_step, m.world_size) == (DumpKind.SNAPSHOT, 11, 20, 2)
    assert m.to_json()["note"] == "x"
    ddir = root.dump_dir("run", info.generation, 4)
    assert read_shard(root, ddir, m.shards_of(A)[0], DType.FLOAT32).keys.tolist() == [1, 3, 5]


def test_a_failing_shard_commits_nothing_and_leaves_no_temporary_file(tmp_path):
    root = ArtifactRoot(str(tmp_path))
    info = _info(root)

    def parts():
        yield _rows([1, 2], 4)
        raise OSError("disk gone")

    rows = {B: {0: _rows([1], 8, DType.FLOAT16)}, A: {0: parts()}}
    with pytest.raises(OSError, match="disk gone"):
        write_dump(root, info, 1, DumpKind.DELTA, rows, 1, 1)
    assert root.list_dumps("run", info.generation) == []
    assert root.list_incomplete_dumps("run", info.generation) == [1]
    assert _tmp_files(root) == []


def test_without_commit_only_the_shards_are_written(tmp_path):
    root = ArtifactRoot(str(tmp_path))
    info = _info(root)
    m = write_dump(root, info, 2, DumpKind.DELTA, {A: {1: _rows([4], 4)}}, 1, 1, commit=False)
    assert root.committed_seqs("run", info.generation) == []
    root.commit_manifest(m)
    assert root.committed_seqs("run", info.generation) == [2]


@pytest.mark.parametrize(
    ("rows", "problem"),
    [
        ({"sparse.c": {0: None}}, r"table 'sparse\.c' is not in GENERATION\.json"),
        ({A: {2: None}}, r"table 'sparse\.a' has rows for rank\(s\) \[2\], outside world size 2"),
    ],
)
def test_rows_outside_the_generation_are_rejected_before_anything_is_written(
    tmp_path, rows, problem
):
    root = ArtifactRoot(str(tmp_path))
    info = _info(root)
    with pytest.raises(BadInputError, match=rf"dump 1 of run 'run' generation 1: {problem}"):
        write_dump(root, info, 1, DumpKind.DELTA, rows, 1, 1)
    assert not root.fs.exists(root.dump_dir("run", info.generation, 1))


def test_a_manifest_from_shards_lists_them_by_table_and_rank_and_sums_each_table():
    def shard(table: str, rank: int, rows: int) -> ShardInfo:
        return ShardInfo(f"{table}/rank-{rank:05d}.parquet", table, rank, rows, 10, "0" * 64)

    m = Manifest.from_shards(
        "run",
        2,
        3,
        DumpKind.DELTA,
        5,
        9,
        2,
        [shard(B, 1, 4), shard(A, 1, 2), shard(B, 0, 1)],
        tables=[B, "sparse.c"],
        extra={"taken_at": "2026-12-02T10:00:00.000000Z"},
    )
    assert [(s.table, s.rank) for s in m.shards] == [(A, 1), (B, 0), (B, 1)]
    assert m.tables == {B: 5, "sparse.c": 0, A: 2}
    assert m.version == (2 << 32) | 3
    assert m.to_json()["taken_at"] == "2026-12-02T10:00:00.000000Z"
    assert Manifest.from_json(m.to_json(), "MANIFEST.json") == m


def test_a_manifests_shards_of_a_table_and_of_one_rank_come_by_rank_from_any_listing_order():
    def shard(table: str, rank: int) -> ShardInfo:
        return ShardInfo(f"{table}/rank-{rank:05d}.parquet", table, rank, 1, 10, "0" * 64)

    listed = [shard(B, 3), shard(A, 2), shard(B, 0), shard(B, 1)]
    obj = Manifest.from_shards("run", 1, 1, DumpKind.DELTA, 1, 1, 4, listed).to_json()
    obj["shards"].reverse()  # a manifest written by another writer, in another order
    m = Manifest.from_json(obj, "MANIFEST.json")
    assert m.shards_of(B) == [shard(B, 0), shard(B, 1), shard(B, 3)]
    assert m.shards_of_rank(B, 1) == [shard(B, 1)] and m.shards_of_rank(A, 2) == [shard(A, 2)]
    assert m.shards_of_rank(B, 2) == [] and m.shards_of_rank("sparse.none", 0) == []
    assert m.shards_of("sparse.none") == []
