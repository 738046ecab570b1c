"""A dump's small shards of one table read as one block: the same replay and rows, each checked.

A replay given a :class:`CheckedShards` reads the shards of a table in one dump (a rank's
each) as a group held as one block; without it, shard by shard. Both must give the same
records, the same rows, and refuse the same bad shard.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest

from deltarec.artifacts import ArtifactRoot, DumpKind, Parent, ShardRows, TableSpec
from deltarec.artifacts.lineage import ExpectedRows, ExpectedState, expected_state
from deltarec.artifacts.wholeshard import CheckedShards
from deltarec.errors import ChecksumError
from deltarec.testing.dumps import new_generation, random_rows, write_dump

RANKS = 4
A, B = "sparse.ebc.a", "sparse.ebc.b"
SPECS = {t: TableSpec(dim=4, num_embeddings=400, sharding="row_wise") for t in (A, B)}


def _by_rank(keys: np.ndarray, seed: int, steps: list[int], evict_every: int = 0) -> dict:
    """Both tables' rows of ``keys`` split over the ranks; rank ``r`` read at ``steps[r]``."""
    out: dict[str, dict[int, ShardRows]] = {}
    for t, table in enumerate((A, B)):
        out[table] = {}
        for rank, part in enumerate(np.array_split(keys, RANKS)):
            ops = (part % evict_every == 0).astype(np.int8) if evict_every else None
            rows = random_rows(part, SPECS[table], seed * 10 + t * RANKS + rank, ops, steps[rank])
            out[table][rank] = rows
    return out


@pytest.fixture
def history(tmp_path) -> tuple[ArtifactRoot, int, int]:
    """Generation 1: a snapshot, a delta with evictions, a delta whose rows straddle step 30,
    a snapshot of half the keys; generation 2 restored at step 30, with a delta of its own."""
    root = ArtifactRoot(str(tmp_path / "artifacts"))
    g1 = new_generation(root, "r", SPECS, world_size=RANKS)
    every = np.arange(400, dtype=np.int64)
    write_dump(root, g1, 0, _by_rank(every, 0, [0] * 4), DumpKind.SNAPSHOT, 0, 0)
    write_dump(root, g1, 1, _by_rank(every[100:300], 1, [10] * 4, evict_every=7), first_step=10)
    write_dump(
        root, g1, 2, _by_rank(every[250:350], 2, [20, 20, 40, 40]), first_step=20, last_step=40
    )
    write_dump(root, g1, 3, _by_rank(every[:200], 3, [50] * 4), DumpKind.SNAPSHOT, 50, 50)
    g2 = new_generation(root, "r", SPECS, world_size=RANKS, parent=Parent(1, 30))
    write_dump(root, g2, 0, _by_rank(every[380:], 4, [31] * 4), first_step=31, last_step=31)
    return root, g1.generation, g2.generation


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _same_replay(grouped: ExpectedState, plain: ExpectedState) -> None:
    for table in (A, B):
        got, want = grouped.tables[table], plain.tables[table]
        for name in ("keys", "versions", "ops", "steps", "_ref_idx", "_row_idx"):
            assert np.array_equal(getattr(got, name), getattr(want, name)), (table, name)
        whole = want.load(want.keys)
        assert np.array_equal(got.load(got.keys), whole)
        some = np.sort(np.random.default_rng(3).choice(got.keys, 50, replace=False))
        loaded = got.load(some)  # a sample: the block's rows gathered, into an array of its own
        assert np.array_equal(loaded, want.load(some)) and loaded.flags.writeable
        with ExpectedRows(got) as rows:
            taken = [rows.take(np.arange(b, min(b + 37, len(got.keys)))) for b in range(0, 400, 37)]
            assert rows._open == {}  # every batch from the blocks: no shard opened
        assert np.array_equal(np.concatenate(taken)[: len(got.keys)], whole)


def test_a_replay_of_shards_read_as_blocks_equals_the_replay_shard_by_shard(history):
    root, g1, g2 = history
    for generation in (g1, g2):
        checked = CheckedShards(root)
        grouped = expected_state(root, "r", generation, checked=checked)
        _same_replay(grouped, expected_state(root, "r", generation))
        block_of, _ = checked.locate(grouped.tables[A]._refs)
        assert (block_of >= 0).any()
    # generation 2 keeps only the rows of dump 2 read at or before step 30 (ranks 0 and 1)
    t = expected_state(root, "r", g2, checked=CheckedShards(root)).tables[A]
    assert sorted(set(t.steps.tolist())) == [0, 10, 20, 31]


def test_removed_records_of_a_block_come_back_as_zero_rows(history):
    root, g1, _ = history
    table = expected_state(root, "r", g1, checked=CheckedShards(root)).tables[B]
    removed = np.flatnonzero(table._ref_idx < 0)  # keys 200..399, gone with the snapshot
    assert len(removed) == 200
    with ExpectedRows(table) as rows:
        got = rows.take(np.arange(190, 210))
    assert not got[10:].any() and got[:10].any()


def test_a_bad_shard_in_a_group_is_refused_by_name_before_any_of_it_is_used(history):
    root, g1, _ = history
    path = os.path.join(root.dump_dir("r", g1, 1), A, "rank-00002.parquet")
    data = bytearray(_read(path))
    data[len(data) // 2] ^= 0xFF
    _write(path, bytes(data))
    with pytest.raises(ChecksumError, match="rank-00002"):
        expected_state(root, "r", g1, checked=CheckedShards(root))


def test_shards_of_other_schemas_in_a_group_are_read_one_by_one_with_the_same_replay(history):
    root, g1, _ = history
    dump_dir = root.dump_dir("r", g1, 1)
    rel = f"{B}/rank-00001.parquet"
    table = pq.read_table(os.path.join(dump_dir, rel))
    pq.write_table(table.select(["op", "key", "embedding", "step"]), os.path.join(dump_dir, rel))
    data = _read(os.path.join(dump_dir, rel))
    manifest_path = os.path.join(dump_dir, "MANIFEST.json")
    manifest = json.loads(_read(manifest_path))
    for shard in manifest["shards"]:
        if shard["path"] == rel:
            shard.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    _write(manifest_path, json.dumps(manifest).encode())
    checked = CheckedShards(root)
    grouped = expected_state(root, "r", g1, checked=checked)
    _same_replay(grouped, expected_state(root, "r", g1))
    block_of, _ = checked.locate(grouped.tables[B]._refs)
    refs = grouped.tables[B]._refs
    in_dump_1 = [i for i, ref in enumerate(refs) if ref.dump_dir == dump_dir]
    assert all(block_of[i] < 0 for i in in_dump_1 if refs[i].shard.table == B)
    assert checked.checked(dump_dir, next(r.shard for r in refs if r.shard.path == rel))
