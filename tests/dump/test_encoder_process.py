"""The encoder process (``DumperConfig.encoder = "process"``) on CPU: same shards, crash safety."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch
from tests._helpers.dump import HandTables, read_dump

from deltarec.artifacts import ArtifactRoot, DType, ShardInfo, check_shard
from deltarec.dump import Dumper, DumperConfig
from deltarec.dump.encoder_process import EncoderLostError, EncoderProcess
from deltarec.errors import DumpError
from deltarec.tracking.gather import HostRows
from deltarec.tracking.pinned import PinnedRing, pinned_slot_bytes


def _config(root, encoder: str, **kw) -> DumperConfig:
    base = dict(artifacts=str(root), run="r", every_steps=3, chunk_rows=16, fsync=False)
    base.update(kw, encoder=encoder)
    return DumperConfig(**base)


def _train(dumper: Dumper, tables: HandTables, steps: range) -> None:
    for step in steps:
        tables.step(step)
        dumper.maybe_dump(step)


def _shards(root, run: str = "r") -> dict[int, list[tuple[str, int, str]]]:
    r = ArtifactRoot(str(root))
    return {
        seq: sorted((s.table, s.rows, s.sha256) for s in r.read_manifest(run, 1, seq).shards)
        for seq in r.list_dumps(run, 1)
    }


def test_the_encoder_process_writes_the_same_shards_byte_for_byte_as_the_threads(tmp_path):
    got = {}
    for encoder in ("thread", "process"):
        tables = HandTables(seed=4)
        cfg = _config(tmp_path / encoder, encoder, table_dtypes={"sparse.b": DType.INT8_ROWWISE})
        d = Dumper(cfg, tables.sources())
        assert d.encoder_process == (encoder == "process")
        d.start(step=0)
        _train(d, tables, range(1, 10))
        d.final_dump(9)
        d.close()
        got[encoder] = _shards(tmp_path / encoder)
    assert got["process"] == got["thread"]
    assert sorted(got["process"]) == [0, 1, 2, 3, 4]  # snapshot, three deltas, the final
    assert all(rows > 0 for _, rows, _ in got["process"][1])


def test_a_process_encoders_rows_are_the_tables_at_each_dump_step(tmp_path):
    tables = HandTables(seed=5)
    d = Dumper(_config(tmp_path, "process"), tables.sources())
    d.start(step=0)
    want = {}
    for step in range(1, 7):
        tables.step(step)
        seq = d.maybe_dump(step)
        if seq is not None:
            touched = tables.take_touched()
            want[seq] = {t: np.array(sorted(k)) for t, k in touched.items()}
            want[seq] = {t: (k, tables.rows_of(t, k)) for t, k in want[seq].items()}
    d.wait_idle()
    d.close()
    root = ArtifactRoot(str(tmp_path))
    for seq, tables_want in want.items():
        got = read_dump(root, "r", 1, seq)
        for t, (keys, rows) in tables_want.items():
            gkeys, grows, _, gsteps = got[t]
            order = np.argsort(gkeys)
            assert np.array_equal(gkeys[order], keys)
            assert np.array_equal(grows[order], rows)
            assert (gsteps == 3 * seq).all()


def test_a_killed_encoder_process_fails_the_dump_in_flight_and_keeps_what_was_committed(
    tmp_path,
):
    tables = HandTables(seed=6)
    d = Dumper(_config(tmp_path, "process", snapshot=False), tables.sources())
    d.start(step=0)
    _train(d, tables, range(1, 4))
    d.wait_idle()  # dump 1 committed
    encoder = d._worker.encoder
    os.kill(encoder.pid, signal.SIGKILL)
    encoder.proc.wait(10)
    with pytest.raises(DumpError) as err:
        _train(d, tables, range(4, 7))  # dump 2 at step 6
        d.wait_idle(timeout=30)
    message = str(err.value)
    assert "dump 2" in message and "encoder process" in message, message
    assert f"pid {encoder.pid}" in message and "killed by signal 9" in message, message
    assert d.pinned is not None and d.pinned.free_slots() == d.pinned.slots  # all given back
    assert d.queue.outstanding_bytes == 0
    d.close(timeout=30)
    root = ArtifactRoot(str(tmp_path))
    assert root.list_dumps("r", 1) == [1]
    for s in root.read_manifest("r", 1, 1).shards:
        check_shard(root, root.dump_dir("r", 1, 1), s)


def test_a_staged_chunk_is_read_from_the_ring_and_its_ops_inline(tmp_path):
    """The layout of a chunk copied out of a device staging buffer: keys and rows in a ring
    slot, ops in host memory of their own; the shard holds exactly those rows."""
    ring = PinnedRing(pinned_slot_bytes(64, 8), 2, shared=True)
    ring.allocate()
    setup = {
        "artifacts": str(tmp_path),
        "storage_options": {},
        "run": "r",
        "generation": 1,
        "rank": 0,
        "tables": {"t": ("float32", 8)},
        "fsync": False,
        "encode_workers": 1,
        "arena_bytes": 1 << 20,
    }
    root = ArtifactRoot(str(tmp_path))
    os.makedirs(root.dump_dir("r", 1, 7), exist_ok=True)
    enc = EncoderProcess(setup, ring)
    try:
        keys = torch.arange(40, dtype=torch.int64) * 3
        rows = torch.randn(40, 8)
        ops = torch.zeros(40, dtype=torch.int8)
        ops[::5] = 1
        slot = ring.take(keys.numel() * 8 + rows.numel() * 4 + 64, keep_one=False)
        assert slot is not None
        hkeys, hrows = slot.carve([keys, rows])
        hkeys.copy_(keys)
        hrows.copy_(rows)
        assert ring.holds(hrows) and not ring.holds(ops)
        released = []
        host = HostRows(hkeys, hrows, ops, slot=slot)
        enc.send_chunk(7, "t", 70, host, lambda: released.append(host.free()))
        shards, error = enc.close_dump(7)
        assert error is None and len(shards) == 1 and released == [None]
        assert ring.free_slots() == 2
        info = ShardInfo(**shards[0])
        check_shard(root, root.dump_dir("r", 1, 7), info)
        from deltarec.artifacts import read_shard

        got = read_shard(root, root.dump_dir("r", 1, 7), info, DType.FLOAT32)
        assert np.array_equal(got.keys, keys.numpy())
        assert np.array_equal(got.embedding.reshape(40, 8), rows.numpy())
        assert np.array_equal(got.ops, ops.numpy()) and (got.steps == 70).all()
    finally:
        enc.stop()
        ring.close()
    assert not enc.alive
    with pytest.raises(EncoderLostError):
        enc.check()
