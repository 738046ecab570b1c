"""The local shard write path: native parquet file, sha256 read back on a helper thread."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pyarrow.parquet as pq
import pytest

from deltarec.artifacts import ArtifactRoot, DType, codec, read_shard
from deltarec.artifacts.shards import ShardRows, ShardWriter


def _rows(rng: np.random.Generator, n: int, dim: int) -> ShardRows:
    return ShardRows(
        keys=rng.permutation(10 * n)[:n].astype(np.int64),
        embedding=rng.standard_normal((n, dim), dtype=np.float32),
        ops=np.zeros(n, np.int8),
        steps=np.full(n, 7, np.int64),
    )


@pytest.mark.parametrize("fsync", [True, False])
def test_a_shard_of_many_blocks_has_the_sha256_and_size_of_its_bytes_and_reads_back(
    tmp_path, fsync
):
    root = ArtifactRoot(str(tmp_path))
    rng = np.random.default_rng(0)
    parts = [_rows(rng, 40_000, 64) for _ in range(8)]  # ~83 MB: helper thread, early syncs
    w = ShardWriter(root, "r", 1, 3, "m.t", 0, DType.FLOAT32, 64, fsync=fsync)
    for p in parts:
        w.write(p)
    info = w.close()
    with open(w.final, "rb") as f:
        data = f.read()
    assert info.bytes == len(data) == os.path.getsize(w.final) > 80 << 20
    assert info.sha256 == hashlib.sha256(data).hexdigest()
    assert info.rows == 320_000 and not os.path.exists(w.tmp)
    back = read_shard(root, root.dump_dir("r", 1, 3), info, DType.FLOAT32)
    assert np.array_equal(back.keys, np.concatenate([p.keys for p in parts]))
    assert np.array_equal(back.embedding, np.concatenate([p.embedding for p in parts]))
    assert pq.ParquetFile(w.final).schema_arrow == codec.shard_schema(DType.FLOAT32, 64)
    assert pq.ParquetFile(w.final).metadata.num_row_groups == 8


def test_a_small_shard_is_hashed_inline_and_an_aborted_one_leaves_no_file(tmp_path):
    root = ArtifactRoot(str(tmp_path))
    rng = np.random.default_rng(1)
    w = ShardWriter(root, "r", 1, 4, "m.t", 0, DType.FLOAT16, 8)
    w.write(_rows(rng, 10, 8))
    info = w.close()
    with open(w.final, "rb") as f:
        assert info.sha256 == hashlib.sha256(f.read()).hexdigest()

    big = ShardWriter(root, "r", 1, 5, "m.t", 0, DType.FLOAT32, 64)
    big.write(_rows(rng, 60_000, 64))  # > one hash block: the helper thread is running
    big.abort()
    assert not os.path.exists(big.tmp) and not os.path.exists(big.final)
