"""Shards: ShardWriter streams and hashes them; iter_shard / read_shard check and read them back."""

from __future__ import annotations

import hashlib
import os
import threading

import numpy as np
import pyarrow.parquet as pq
import pytest

from deltarec.artifacts import (
    ArtifactRoot,
    DType,
    ShardRows,
    ShardWriter,
    check_shard,
    codec,
    iter_shard,
    read_shard,
)
from deltarec.artifacts.shards import READ_ROWS, ShardPlace
from deltarec.artifacts.types import ShardInfo
from deltarec.errors import ArtifactError, ChecksumError


def _rows(rng: np.random.Generator, n: int, dim: int) -> ShardRows:
    return ShardRows(
        keys=rng.permutation(10 * n)[:n].astype(np.int64),
        embedding=rng.standard_normal((n, dim), dtype=np.float32),
        ops=np.zeros(n, np.int8),
        steps=np.full(n, 7, np.int64),
    )


# ---- writing ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fsync", [True, False])
def test_a_shard_of_many_blocks_has_the_sha256_and_size_of_its_bytes_and_reads_back(
    tmp_path, fsync
):
    root = ArtifactRoot(str(tmp_path))
    rng = np.random.default_rng(0)
    parts = [_rows(rng, 40_000, 64) for _ in range(8)]  # ~83 MB: helper thread, early syncs
    w = ShardWriter(root, ShardPlace("r", 1, 3, "m.t", 2), DType.FLOAT32, 64, fsync=fsync)
    for p in parts:
        w.write(p)
    info = w.close()
    with open(w.final, "rb") as f:
        data = f.read()
    assert info.bytes == len(data) == os.path.getsize(w.final) > 80 << 20
    assert info.sha256 == hashlib.sha256(data).hexdigest()
    assert info.rows == 320_000 and info.path == "m.t/rank-00002.parquet"
    assert not os.path.exists(w.tmp)
    ddir = root.dump_dir("r", 1, 3)
    check_shard(root, ddir, info)
    back = read_shard(root, ddir, info, DType.FLOAT32)
    assert np.array_equal(back.keys, np.concatenate([p.keys for p in parts]))
    assert np.array_equal(back.embedding, np.concatenate([p.embedding for p in parts]))
    assert pq.ParquetFile(w.final).schema_arrow == codec.shard_schema(DType.FLOAT32, 64)
    meta = pq.ParquetFile(w.final).metadata  # each write in groups of <= 2M values
    per_write = -(-40_000 // codec.row_group_rows(DType.FLOAT32, 64))
    assert codec.row_group_rows(DType.FLOAT32, 64) == 32_768 and per_write == 2
    assert meta.num_row_groups == 8 * per_write
    assert max(meta.row_group(i).num_rows for i in range(meta.num_row_groups)) == 32_768


def test_a_small_shard_is_hashed_inline_without_a_helper_thread(tmp_path):
    root = ArtifactRoot(str(tmp_path))
    before = threading.active_count()
    w = ShardWriter(root, ShardPlace("r", 1, 4, "m.t", 0), DType.FLOAT16, 8)
    w.write(_rows(np.random.default_rng(1), 10, 8))
    assert threading.active_count() == before
    info = w.close()
    with open(w.final, "rb") as f:
        assert info.sha256 == hashlib.sha256(f.read()).hexdigest()


@pytest.mark.parametrize("rows", [10, 60_000], ids=["small", "hashing-thread-running"])
def test_an_aborted_shard_leaves_no_file_and_no_hashing_thread(tmp_path, rows):
    root = ArtifactRoot(str(tmp_path))
    before = threading.active_count()
    w = ShardWriter(root, ShardPlace("r", 1, 5, "m.t", 0), DType.FLOAT32, 64)
    w.write(_rows(np.random.default_rng(2), rows, 64))  # 60k rows: more than one hash block
    w.abort()
    assert threading.active_count() == before
    assert not os.path.exists(w.tmp) and not os.path.exists(w.final)
    assert root.fs.ls(root.dump_dir("r", 1, 5) + "/m.t") == []


def test_encoded_rows_of_every_dtype_round_trip_through_a_shard(tmp_path):
    root = ArtifactRoot(str(tmp_path))
    values = np.random.default_rng(1).standard_normal((50, 16)).astype(np.float32)
    for i, dtype in enumerate(DType):
        w = ShardWriter(root, ShardPlace("r", 1, i, "t.z", 0), dtype, 16)
        w.write(
            ShardRows(
                np.arange(50),
                codec.encode(values, dtype),
                np.zeros(50, np.int8),
                np.zeros(50, np.int64),
            )
        )
        info = w.close()
        back = read_shard(root, root.dump_dir("r", 1, i), info, dtype)
        decoded = codec.decode(back.embedding, dtype, 16)
        tol = codec.tolerance(dtype, values)
        assert (np.abs(decoded - values).max(axis=1) <= tol + 1e-7).all(), dtype


# ---- reading ------------------------------------------------------------------------------------
def _shard(tmp_path, groups: list[int]) -> tuple[ArtifactRoot, str, ShardInfo, ShardRows]:
    """A float32 dim-4 shard written in row groups of the given sizes."""
    root = ArtifactRoot(str(tmp_path))
    rng = np.random.default_rng(3)
    parts = [_rows(rng, n, 4) for n in groups]
    with ShardWriter(root, ShardPlace("r", 1, 0, "t.r", 0), DType.FLOAT32, 4, fsync=False) as w:
        for p in parts:
            w.write(p)
        info = w.close()
    return root, root.dump_dir("r", 1, 0), info, ShardRows.concat(parts)


@pytest.mark.parametrize("batch_rows", [1000, 20_000])
def test_bounded_memory_reading_yields_every_row_in_batches_of_about_batch_rows(
    tmp_path, batch_rows
):
    root, ddir, info, want = _shard(tmp_path, [10_000, 30_000, 5_000])
    got = list(iter_shard(root, ddir, info, DType.FLOAT32, batch_rows, bounded_memory=True))
    whole = ShardRows.concat(got)
    assert np.array_equal(whole.keys, want.keys)
    assert np.array_equal(whole.embedding, want.embedding)
    assert np.array_equal(whole.steps, want.steps)
    # every batch but the last holds batch_rows, plus less than one read of READ_ROWS
    slack = min(READ_ROWS, batch_rows)
    assert all(batch_rows <= len(b) < batch_rows + slack for b in got[:-1])
    assert 0 < len(got[-1]) < batch_rows + slack


def test_default_reading_yields_batches_of_at_most_batch_rows(tmp_path):
    root, ddir, info, want = _shard(tmp_path, [10_000, 30_000])
    got = list(iter_shard(root, ddir, info, DType.FLOAT32, batch_rows=7000))
    assert max(len(b) for b in got) <= 7000
    assert np.array_equal(ShardRows.concat(got).keys, want.keys)


@pytest.mark.parametrize("bounded", [False, True])
def test_a_shard_holding_other_rows_than_its_manifest_entry_fails_when_read(tmp_path, bounded):
    root, ddir, info, _ = _shard(tmp_path, [100])
    more = ShardInfo(info.path, info.table, info.rank, 101, info.bytes, info.sha256)
    with pytest.raises(ChecksumError, match=r"rank-00000\.parquet.*holds 100 rows.*says 101"):
        list(iter_shard(root, ddir, more, DType.FLOAT32, bounded_memory=bounded))


@pytest.mark.parametrize("bounded", [False, True])
@pytest.mark.parametrize("verify", [False, True])
def test_a_missing_shard_is_named_when_read(tmp_path, bounded, verify):
    root, ddir, info, _ = _shard(tmp_path, [100])
    os.remove(os.path.join(ddir, info.path))
    with pytest.raises(ArtifactError, match=r"rank-00000\.parquet.*missing"):
        list(iter_shard(root, ddir, info, DType.FLOAT32, verify=verify, bounded_memory=bounded))


@pytest.mark.parametrize("bounded", [False, True])
def test_a_corrupt_shard_fails_its_checksum_before_any_row_or_unread_as_parquet(tmp_path, bounded):
    root, ddir, info, _ = _shard(tmp_path, [100])
    path = os.path.join(ddir, info.path)
    with open(path, "r+b") as f:  # the parquet magic at the end of the file
        f.seek(-2, os.SEEK_END)
        f.write(b"XX")
    rows = iter_shard(root, ddir, info, DType.FLOAT32, bounded_memory=bounded)
    with pytest.raises(ChecksumError, match=r"rank-00000\.parquet.*sha256"):
        next(rows)
    unchecked = iter_shard(root, ddir, info, DType.FLOAT32, verify=False, bounded_memory=bounded)
    with pytest.raises(ArtifactError, match=r"rank-00000\.parquet.*unreadable parquet"):
        list(unchecked)
