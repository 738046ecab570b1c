"""ShardWriter: streamed shards whose sha256 (hashed on a helper thread) matches the file."""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest

from deltarec.artifacts import (
    ArtifactRoot,
    DType,
    ShardRows,
    ShardWriter,
    check_shard,
    codec,
    read_shard,
)
from deltarec.errors import ChecksumError


def _rows(n: int, dim: int, seed: int) -> ShardRows:
    rng = np.random.default_rng(seed)
    return ShardRows(
        keys=np.arange(seed * n, (seed + 1) * n, dtype=np.int64),
        embedding=rng.standard_normal((n, dim)).astype(np.float32),
        ops=np.zeros(n, np.int8),
        steps=np.full(n, 7, np.int64),
    )


def test_a_multi_block_shard_round_trips_and_its_sha256_matches_the_file(tmp_path):
    root = ArtifactRoot(str(tmp_path))
    w = ShardWriter(root, "r", 1, 0, "t.x", 3, DType.FLOAT32, 64)
    parts = [_rows(20_000, 64, i) for i in range(4)]  # ~20 MiB: several hashing blocks
    for p in parts:
        w.write(p)
    info = w.close()
    path = root.shard_path("r", 1, 0, "t.x", 3)
    with open(path, "rb") as f:
        data = f.read()
    assert info.sha256 == hashlib.sha256(data).hexdigest() and info.bytes == len(data)
    assert info.rows == 80_000 and info.path == "t.x/rank-00003.parquet"
    ddir = root.dump_dir("r", 1, 0)
    check_shard(root, ddir, info)
    back = read_shard(root, ddir, info, DType.FLOAT32)
    assert np.array_equal(back.keys, np.concatenate([p.keys for p in parts]))
    assert np.array_equal(back.embedding, np.concatenate([p.embedding for p in parts]))
    with open(path, "r+b") as f:  # flip one byte: the check names the shard
        f.seek(len(data) // 2)
        f.write(bytes([data[len(data) // 2] ^ 1]))
    with pytest.raises(ChecksumError, match=r"rank-00003\.parquet"):
        check_shard(root, ddir, info)


def test_an_aborted_shard_leaves_no_file_and_no_hashing_thread(tmp_path):
    root = ArtifactRoot(str(tmp_path))
    before = threading.active_count()
    w = ShardWriter(root, "r", 1, 0, "t.y", 0, DType.FLOAT16, 8)
    w.write(
        ShardRows(
            np.arange(10),
            codec.encode(np.ones((10, 8)), DType.FLOAT16),
            np.zeros(10, np.int8),
            np.zeros(10, np.int64),
        )
    )
    w.abort()
    assert threading.active_count() == before
    assert not root.fs.exists(root.shard_path("r", 1, 0, "t.y", 0))
    assert root.fs.ls(root.dump_dir("r", 1, 0) + "/t.y") == []


def test_encoded_rows_of_every_dtype_round_trip_through_a_shard(tmp_path):
    root = ArtifactRoot(str(tmp_path))
    values = np.random.default_rng(1).standard_normal((50, 16)).astype(np.float32)
    for i, dtype in enumerate(DType):
        w = ShardWriter(root, "r", 1, i, "t.z", 0, dtype, 16)
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
