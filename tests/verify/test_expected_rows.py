"""ExpectedRows: the expected rows of a table read by position, row group by row group."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq

from deltarec.artifacts import DumpKind, ShardRows, codec, write_dump
from deltarec.artifacts.lineage import ExpectedRows, expected_state


def _snapshot_in_row_groups(lineage, gen: int, keys: np.ndarray, groups: int) -> None:
    """Dump 0 of ``gen``: a snapshot of T_EMB written in ``groups`` row groups."""
    spec = lineage.specs[lineage.T_EMB]
    parts = [
        ShardRows(
            part,
            codec.encode(lineage.values(part, 0.5, spec.dim), spec.dtype),
            np.zeros(len(part), np.int8),
            np.ones(len(part), np.int64),
        )
        for part in np.array_split(keys, groups)
    ]
    info = lineage.root.read_generation(lineage.run, gen)
    write_dump(lineage.root, info, 0, DumpKind.SNAPSHOT, {lineage.T_EMB: {0: parts}}, 1, 1)
    lineage.step = 1


def _table(lineage):
    gen = lineage.generation()
    _snapshot_in_row_groups(lineage, gen, np.arange(0, 600, dtype=np.int64), groups=4)
    updated = np.arange(100, 400, 3, dtype=np.int64)
    ops = (updated % 2).astype(np.int8)  # every other updated key evicted
    lineage.dump(gen, 1, {lineage.T_EMB: (updated, 1.5, ops)})
    lineage.dump(gen, 2, {lineage.T_EMB: (np.arange(550, 700, dtype=np.int64), 2.5)})
    table = expected_state(lineage.root, lineage.run, gen).tables[lineage.T_EMB]
    ref = table._refs[0]
    path = f"{ref.dump_dir}/{ref.shard.path}"
    assert pq.ParquetFile(path).metadata.num_row_groups == 4
    return table


def test_rows_read_in_key_order_equal_the_whole_load_and_stay_streamed(lineage):
    table = _table(lineage)
    whole = table.load(table.keys)
    with ExpectedRows(table) as rows:
        got = [rows.take(np.arange(b, min(b + 37, len(table.keys)))) for b in range(0, 700, 37)]
        assert rows.streamed
    assert np.array_equal(np.concatenate(got), whole)
    # the snapshot's rows where no later dump wrote, then the delta's values
    assert np.array_equal(whole[:100], lineage.expected_row(lineage.T_EMB, np.arange(100), 0.5))
    assert np.array_equal(
        whole[650:], lineage.expected_row(lineage.T_EMB, np.arange(650, 700), 2.5)
    )


def test_rows_read_in_any_order_are_right_and_fall_back_to_one_load_when_scattered(lineage):
    table = _table(lineage)
    whole = table.load(table.keys)
    order = np.random.default_rng(1).permutation(len(table.keys))
    for cache_bytes in (256 << 20, 1):
        with ExpectedRows(table, cache_bytes=cache_bytes) as rows:
            for b in range(0, len(order), 50):
                pos = order[b : b + 50]
                assert np.array_equal(rows.take(pos), whole[pos])
            assert not rows.streamed  # row groups decoded over and over, or too many held


def test_index_of_a_run_of_records_and_of_any_other_keys(lineage):
    table = _table(lineage)  # records of keys 0..699
    assert table.index_of(np.arange(40, 90)).tolist() == list(range(40, 90))
    assert table.index_of(np.array([5, 6, 700, 7])).tolist() == [5, 6, -1, 7]
    assert table.index_of(np.array([9, 3, -1])).tolist() == [9, 3, -1]
    assert table.index_of(np.array([698, 699, 700])).tolist() == [698, 699, -1]


def test_rows_in_shard_order_are_each_record_s_row_as_the_whole_load_gives_it(lineage):
    """Whole shards, shards only some of whose rows are records, evicted records, and records
    a later snapshot removed (a zero row): each comes back as :meth:`load` gives it."""
    table = _table(lineage)
    gen = lineage.generation()
    lineage.dump(gen, 0, {lineage.T_EMB: (np.arange(0, 200, dtype=np.int64), 0.5)})
    lineage.dump(gen, 1, {lineage.T_EMB: (np.arange(100, 300, 2, dtype=np.int64), 1.5)})
    lineage.dump(
        gen, 2, {lineage.T_EMB: (np.arange(150, 400, dtype=np.int64), 2.5)}, kind=DumpKind.SNAPSHOT
    )
    later = expected_state(lineage.root, lineage.run, gen).tables[lineage.T_EMB]
    assert (later._ref_idx < 0).sum() == 150  # keys 0..149: removed by the snapshot
    for t in (table, later):
        rows, at = t.load_in_shard_order()
        assert rows.shape == (len(t.keys) + 1, rows.shape[1])
        assert np.array_equal(rows[at], t.load(t.keys))


def test_index_of_many_keys_in_no_order_finds_each_record_and_misses_the_rest(lineage):
    table = _table(lineage)  # records of keys 0..699
    keys = np.random.default_rng(3).permutation(np.arange(-50, 2000, dtype=np.int64))
    want = np.where((keys >= 0) & (keys < 700), keys, -1)
    assert table.index_of(keys).tolist() == want.tolist()


def test_positions_of_a_batch_are_grouped_by_shard_in_order_without_removed_records():
    from deltarec.artifacts.expected import _by_ref

    ref_idx = np.array([3, -1, 0, 3, 7, 0, -1, 3], dtype=np.int32)
    got = [(r, pos.tolist()) for r, pos in _by_ref(ref_idx)]
    assert got == [(0, [2, 5]), (3, [0, 3, 7]), (7, [4])]
    assert _by_ref(np.array([-1, -1], dtype=np.int32)) == []
    assert _by_ref(np.empty(0, dtype=np.int32)) == []
