"""The dumper with tables on a CUDA device (pinned asynchronous copies); skipped without CUDA.

Runs without torchrec: tables are plain CUDA tensors whose lookups are recorded by hand, on one
process and on 2 ranks sharing the GPU (gloo for the dumper's own exchanges).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dump_helpers import read_dump

from deltarec.artifacts import ArtifactRoot, TableKind, TableSpec
from deltarec.artifacts.lineage import expected_state
from deltarec.dump import Dumper, DumperConfig, gather_to_host
from deltarec.testing.multiprocess import run_on_ranks
from deltarec.tracking.plain import ColumnShard, ColumnShardSource, ReplicatedSource, RowShardSource
from deltarec.tracking.tracker import ManualTracker, TrackerHub

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_gathered_chunks_land_in_pinned_memory_and_match_the_table():
    w = torch.randn(10_000, 32, device="cuda")
    ids = torch.unique(torch.randint(0, 10_000, (3000,), device="cuda"))
    chunks = list(gather_to_host(w, ids, chunk_rows=512, key_offset=7))
    for c in chunks:
        c.wait()
        assert c.rows.is_pinned() and c.keys.device.type == "cpu"
    assert torch.equal(torch.cat([c.rows for c in chunks]), w[ids].cpu())
    assert torch.equal(torch.cat([c.keys for c in chunks]), (ids + 7).cpu())


def test_a_cuda_table_is_dumped_with_the_rows_of_each_dump_step(tmp_path):
    tracker = ManualTracker()
    hub = TrackerHub(tracker, {"a"})
    w = torch.randn(20_000, 16, device="cuda")
    spec = TableSpec(dim=16, kind=TableKind.PLAIN, num_embeddings=20_000)
    src = RowShardSource("m.a", spec, hub, "a", w, 100)
    d = Dumper(DumperConfig(artifacts=str(tmp_path), run="c", every_steps=2, chunk_rows=999), [src])
    d.start(step=0)
    want = {}
    touched: set[int] = set()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for step in range(1, 7):
        ids = torch.randint(0, 20_000, (1500,), device="cuda", generator=gen)
        tracker.record("a", ids)
        touched.update((ids + 100).tolist())
        w[ids] += 0.5  # the step changes exactly the looked-up rows (asynchronously)
        if d.maybe_dump(step) is not None:
            keys = np.array(sorted(touched))
            want[step] = (keys, w[torch.from_numpy(keys - 100).cuda()].cpu().numpy())
            touched = set()
    d.final_dump(6)
    d.close()
    root = ArtifactRoot(str(tmp_path))
    for seq in (1, 2, 3):
        m = root.read_manifest("c", 1, seq)
        keys, rows, _, _ = read_dump(root, "c", 1, seq)["m.a"]
        order = np.argsort(keys)
        wk, wr = want[m.last_step]
        assert np.array_equal(keys[order], wk) and np.array_equal(rows[order], wr)
    et = expected_state(root, "c", 1).tables["m.a"]
    assert np.array_equal(et.load(et.keys), w.cpu().numpy()[et.keys - 100])


def _cuda_ranks(rank: int, world_size: int, tmp: str) -> dict:
    torch.manual_seed(0)
    full = torch.randn(500, 8, device="cuda")  # same values on both ranks
    tracker = ManualTracker()
    hub = TrackerHub(tracker, {"dp", "cw"})
    spec = TableSpec(dim=8, kind=TableKind.PLAIN, num_embeddings=500)
    cols = [ColumnShard(4 * rank, full[:, 4 * rank : 4 * rank + 4].clone())]
    sources = [
        ReplicatedSource("m.dp", spec, hub, "dp", full.clone()),
        ColumnShardSource("m.cw", spec, hub, "cw", cols, writer_rank=0),
    ]
    d = Dumper(DumperConfig(artifacts=tmp, run="cr", snapshot=False, chunk_rows=64), sources)
    d.start(step=0)
    mine = torch.arange(rank * 100, rank * 100 + 150, device="cuda")  # ranks overlap at 100-149
    tracker.record("dp", mine)
    tracker.record("cw", torch.arange(0, 250, device="cuda"))  # every column holder sees all
    m = d.final_dump(1)
    d.close()
    return {"seq": m.seq, "full": full.cpu().numpy()}


def test_data_parallel_and_column_wise_cuda_tables_on_two_ranks(tmp_path):
    res = run_on_ranks(_cuda_ranks, 2, args=(str(tmp_path),), timeout_s=180)
    root = ArtifactRoot(str(tmp_path))
    got = read_dump(root, "cr", 1, res[0]["seq"])
    full = res[0]["full"]
    keys, rows, _, _ = got["m.dp"]
    assert np.array_equal(np.sort(keys), np.arange(0, 250))
    assert np.array_equal(rows[np.argsort(keys)], full[:250])
    keys, rows, _, _ = got["m.cw"]
    assert np.array_equal(np.sort(keys), np.arange(0, 250))
    assert np.array_equal(rows[np.argsort(keys)], full[:250])
    m = root.read_manifest("cr", 1, res[0]["seq"])
    assert {s.rank for s in m.shards} == {0}  # one writer per table
