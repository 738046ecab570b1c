"""The dumper on one process with hand-driven plain-torch tables (no torchrec, no ranks)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from tests._helpers.dump import HandTables, assert_rows, read_dump

from deltarec.artifacts import ArtifactRoot, DType, Parent, check_shard
from deltarec.artifacts.lineage import expected_state, keys_published_after
from deltarec.dump import Dumper, DumperConfig
from deltarec.dump.encode import ParallelShardWriter, encode_scratch_bytes
from deltarec.errors import ConfigError, DumpError


def _config(root, **kw) -> DumperConfig:
    base = dict(artifacts=str(root), run="r", every_steps=3, chunk_rows=16, fsync=False)
    base.update(kw)
    return DumperConfig(**base)


def test_each_delta_holds_exactly_the_touched_keys_with_the_rows_at_that_step(tmp_path):
    tables = HandTables()
    cfg = _config(tmp_path, table_dtypes={"sparse.b": DType.FLOAT16})
    d = Dumper(cfg, tables.sources())
    info = d.start(step=0)
    root = ArtifactRoot(str(tmp_path))
    assert info.generation == 1 and info.parent is None
    assert info.tables["sparse.b"].dtype is DType.FLOAT16
    snapshot_rows = {t: w.clone().numpy() for t, w in tables.weights.items()}
    expected = {}
    for step in range(1, 10):
        tables.step(step)
        seq = d.maybe_dump(step)
        assert (seq is not None) == (step % 3 == 0)
        if seq is not None:
            touched = tables.take_touched()
            expected[seq] = {
                t: (np.array(sorted(touched[t])), tables.rows_of(t, np.array(sorted(touched[t]))))
                for t in tables.weights
            }
    last = d.final_dump(9)
    d.close()
    assert last.seq == 4 and last.kind.value == "final"
    assert root.list_dumps("r", 1) == [0, 1, 2, 3, 4]
    snap = read_dump(root, "r", 1, 0)
    for t, (keys, rows, _, steps) in snap.items():
        assert len(keys) == tables.weights[t].shape[0]
        assert_rows(t, info.tables[t].dtype, rows, snapshot_rows[t][keys - tables.offsets[t]])
        assert (steps == 0).all()
    for seq, want in expected.items():
        m = root.read_manifest("r", 1, seq)
        assert (m.first_step, m.last_step) == (3 * seq - 2, 3 * seq)
        for s in m.shards:
            check_shard(root, root.dump_dir("r", 1, seq), s)
        got = read_dump(root, "r", 1, seq)
        for t, (keys, rows) in want.items():
            gkeys, grows, gops, gsteps = got[t]
            assert len(np.unique(gkeys)) == len(gkeys)
            order = np.argsort(gkeys)
            assert np.array_equal(gkeys[order], keys)
            assert_rows(t, info.tables[t].dtype, grows[order], rows)
            assert (gops == 0).all() and (gsteps == 3 * seq).all()
            assert m.tables[t] == len(keys)
    # final dump at step 9 right after the delta of step 9: empty, still committed
    assert sum(last.tables.values()) == 0 and (last.first_step, last.last_step) == (9, 9)


def _train_to(d: Dumper, tables: HandTables, last_step: int) -> None:
    """Start ``d`` at step 0, train ``tables`` through ``last_step`` with a ``maybe_dump`` per
    step, then the final dump and close."""
    d.start(step=0)
    for step in range(1, last_step + 1):
        tables.step(step)
        d.maybe_dump(step)
    d.final_dump(last_step)
    d.close()


def test_replaying_every_dump_reproduces_the_final_tables(tmp_path):
    tables = HandTables(seed=1)
    d = Dumper(_config(tmp_path, every_steps=4), tables.sources())
    _train_to(d, tables, 10)
    state = expected_state(ArtifactRoot(str(tmp_path)), "r", 1)
    for t, w in tables.weights.items():
        et = state.tables[t]
        assert len(et.keys) == w.shape[0]
        got = et.load(et.keys)
        assert np.array_equal(got, w.numpy()[et.keys - tables.offsets[t]])


def test_evaluation_lookups_are_not_dumped(tmp_path):
    tables = HandTables(seed=2)
    d = Dumper(_config(tmp_path, every_steps=None, snapshot=False), tables.sources())
    d.start(step=0)
    tables.step(1)
    train_touched = tables.take_touched()
    d.before_eval()
    tables.step(0, n=50)  # eval lookups (recorded by the tracker, not training updates)
    tables.take_touched()
    d.after_eval()
    m = d.final_dump(1)
    d.close()
    got = read_dump(ArtifactRoot(str(tmp_path)), "r", 1, m.seq)
    for t in tables.weights:
        assert set(got[t][0].tolist()) == train_touched[t]


def test_the_byte_bounded_queue_makes_training_wait_instead_of_growing(tmp_path, monkeypatch):
    slow_write = ParallelShardWriter._append

    def write(self, data):  # the writer holds its first chunk until the training thread waits
        deadline = time.monotonic() + 60
        while d.queue.blocked_puts == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        slow_write(self, data)

    monkeypatch.setattr(ParallelShardWriter, "_append", write)
    tables = HandTables(seed=3, rows=4000, dim=32)
    cap = 1 << 20  # a chunk of sparse.a: 31 kB of rows and piece, 366 kB of encoding scratch
    cfg = _config(tmp_path, queue_bytes=cap, chunk_rows=100, encode_workers=2)
    d = Dumper(cfg, tables.sources())
    d.start(step=0)  # snapshot: 4000 + 2000 rows in 60 chunks of <= 12.9 kB
    assert d.queue.blocked_puts > 0  # the training thread waited for the writer
    d.final_dump(0)
    d.close()
    assert d.queue.blocked_puts > 0
    assert d.plan.encode_threads == 1  # 1/4 of the budget affords less than one scratch: 1 runs
    scratch = encode_scratch_bytes(DType.FLOAT32, 32, 100)
    assert d.queue.capacity == cap - d.plan.arena_bytes - scratch
    assert 0 < d.queue.peak_bytes <= d.queue.capacity
    snap = read_dump(ArtifactRoot(str(tmp_path)), "r", 1, 0)
    assert len(snap["sparse.a"][0]) == 4000 and len(snap["sparse.b"][0]) == 2000


def test_a_worker_failure_is_raised_at_the_next_call_naming_dump_and_table(tmp_path, monkeypatch):
    tables = HandTables(seed=4)
    d = Dumper(_config(tmp_path, snapshot=False, every_steps=1), tables.sources())
    d.start(step=0)
    real_write = ParallelShardWriter._append

    def failing(self, data):
        if self.table == "sparse.b" and self.size > 0:  # the first chunk's bytes
            raise OSError("disk full")
        real_write(self, data)

    monkeypatch.setattr(ParallelShardWriter, "_append", failing)
    tables.step(1)
    assert d.maybe_dump(1) == 1
    with pytest.raises(DumpError) as e:
        d.wait_idle(timeout=30)
    assert "dump 1" in str(e.value) and "sparse.b" in str(e.value) and "disk full" in str(e.value)
    tables.step(2)
    with pytest.raises(DumpError, match=r"dump 1 table 'sparse\.b'"):
        d.maybe_dump(2)
    d.close()
    root = ArtifactRoot(str(tmp_path))
    assert root.list_dumps("r", 1) == [] and root.list_incomplete_dumps("r", 1) == [1]


def test_a_crash_before_the_manifest_leaves_no_manifest_and_the_next_start_cleans_it(
    tmp_path, monkeypatch
):
    tables = HandTables(seed=5)
    root = ArtifactRoot(str(tmp_path))

    def crash(self, manifest):
        raise KeyboardInterrupt("killed between shard writes and manifest")

    d = Dumper(_config(tmp_path, every_steps=None), tables.sources())
    d.start(step=0)
    d.wait_idle(timeout=30)
    monkeypatch.setattr(ArtifactRoot, "commit_manifest", crash)
    tables.step(1)
    d.dump_now(1)
    with pytest.raises(DumpError):
        d.wait_idle(timeout=30)
    d.close()
    assert root.list_dumps("r", 1) == [0]
    assert root.list_incomplete_dumps("r", 1) == [1]
    assert root.fs.ls(root.dump_dir("r", 1, 1))  # the shards were written
    monkeypatch.undo()
    d2 = Dumper(_config(tmp_path, every_steps=None), HandTables(seed=5).sources())
    info = d2.start(step=0)
    d2.close()
    assert info.generation == 2
    assert root.list_incomplete_dumps("r", 1) == []
    assert not root.fs.exists(root.dump_dir("r", 1, 1))


def test_a_restore_republishes_exactly_the_keys_published_after_the_checkpoint(tmp_path):
    tables = HandTables(seed=6)
    root = ArtifactRoot(str(tmp_path))
    d = Dumper(_config(tmp_path, every_steps=2), tables.sources())
    d.start(step=0)
    for step in range(1, 5):
        tables.step(step)
        d.maybe_dump(step)
    d.wait_idle(timeout=30)
    checkpoint = {t: w.clone() for t, w in tables.weights.items()}
    state = d.state_dict()
    assert state["step"] == 4 and state["generation"] == 1
    for step in range(5, 9):
        tables.step(step)
        d.maybe_dump(step)
    d.close()  # the process dies after dump 4 (step 8); no final dump
    # restart from the checkpoint of step 4
    restored = HandTables(seed=6)
    for t, w in checkpoint.items():
        restored.weights[t].copy_(w)
    want = keys_published_after(root, "r", Parent(1, 4))
    assert want and all(len(k) for k in want.values())
    d2 = Dumper(_config(tmp_path, every_steps=2), restored.sources())
    d2.load_state_dict(state)
    info = d2.start(step=4, restored_from=4)
    d2.wait_idle(timeout=30)
    assert info.parent == Parent(1, 4) and info.generation == 2
    m = root.read_manifest("r", 2, 1)
    assert (m.first_step, m.last_step) == (4, 4)
    got = read_dump(root, "r", 2, 1)
    for t in tables.weights:
        keys, rows, _, steps = got[t]
        order = np.argsort(keys)
        assert np.array_equal(keys[order], want.get(t, np.empty(0, np.int64)))
        assert np.array_equal(rows[order], restored.rows_of(t, keys[order]))
        assert (steps == 4).all()
    # the restored lineage now matches the restored model for every republished key
    state2 = expected_state(root, "r", 2)
    for t, w in restored.weights.items():
        et = state2.tables[t]
        assert np.array_equal(et.load(et.keys), w.numpy()[et.keys - restored.offsets[t]])
    d2.close()


def test_time_cadence_dumps_when_the_minutes_have_passed(tmp_path, monkeypatch):
    clock = [1.0e9]  # the dumper's clock, advanced 10 ms per training step

    class Clock:
        def __getattr__(self, name):
            return getattr(time, name)

        def time(self):
            return clock[0]

    monkeypatch.setattr("deltarec.dump.dumper.time", Clock())
    tables = HandTables(seed=7)
    cfg = _config(tmp_path, every_steps=None, every_minutes=0.5 / 60, snapshot=False)
    d = Dumper(cfg, tables.sources())
    d.start(step=0)
    dumps = []
    t0 = clock[0]
    for step in range(1, 200):
        tables.step(step, n=1)
        clock[0] += 0.01
        if d.maybe_dump(step) is not None:
            dumps.append((step, clock[0] - t0))
        if len(dumps) == 2:
            break
    d.close()
    assert len(dumps) == 2
    (_, t1), (s2, t2) = dumps
    assert 0.5 <= t1 <= 0.52 and 0.5 <= t2 - t1 <= 0.52, dumps  # late by at most one step
    assert d._cadence is not None and d._cadence.syncs < s2  # not one agreement per step


def test_bad_configuration_is_rejected_with_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="extra"):
        DumperConfig(artifacts=str(tmp_path), run="r", every_step=3)
    with pytest.raises(ValueError, match="run name"):
        DumperConfig(artifacts=str(tmp_path), run="a/b")
    tables = HandTables()
    d = Dumper(_config(tmp_path, table_dtypes={"sparse.nope": DType.FLOAT16}), tables.sources())
    with pytest.raises(ConfigError, match=r"sparse\.nope"):
        d.start(step=0)
    d.close()


def test_gather_to_host_yields_chunks_with_offset_keys():
    from deltarec.tracking.gather import dedup_ids, gather_to_host

    w = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    ids = dedup_ids(torch.tensor([7, 1, 7, 3, 1]))
    chunks = list(gather_to_host(w, ids, chunk_rows=2, key_offset=100))
    assert [c.keys.tolist() for c in chunks] == [[101, 103], [107]]
    assert torch.equal(torch.cat([c.rows for c in chunks]), w[[1, 3, 7]])
    w[1] = -1  # the gathered rows are a copy taken at gather time
    assert chunks[0].rows[0, 0].item() == 4.0


def test_tables_larger_than_snapshot_max_bytes_get_no_snapshot_and_deltas_still_commit(tmp_path):
    tables = HandTables()
    share = sum(s.spec.num_embeddings * s.spec.dim * 4 for s in tables.sources())
    d = Dumper(_config(tmp_path, snapshot_max_bytes=share - 1), tables.sources())
    _train_to(d, tables, 3)
    root = ArtifactRoot(str(tmp_path))
    assert root.list_dumps("r", 1) == [1, 2]  # no dump 0: the rows exceed the limit
    d2 = Dumper(_config(tmp_path, run="s", snapshot_max_bytes=share), HandTables().sources())
    d2.start(step=0)
    d2.final_dump(0)
    d2.close()
    assert (
        root.list_dumps("s", 1)[0] == 0 and root.read_manifest("s", 1, 0).kind.value == "snapshot"
    )
