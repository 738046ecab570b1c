"""The dumper with tables on a CUDA device (pinned asynchronous copies); skipped without CUDA.

Runs without torchrec: tables are plain CUDA tensors whose lookups are recorded by hand, on one
process and on 2 ranks sharing the GPU (gloo for the dumper's own exchanges).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests._helpers.dump import read_dump

from deltarec.artifacts import ArtifactRoot, TableKind, TableSpec
from deltarec.artifacts.lineage import expected_state
from deltarec.dump import Dumper, DumperConfig
from deltarec.testing.multiprocess import run_on_ranks
from deltarec.tracking.gather import gather_to_host
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


@pytest.mark.parametrize("device_room", [None, 1024, 6000 * (32 * 4 + 8)])
def test_a_cuda_dump_is_staged_on_the_device_or_gathered_to_host_when_the_buffer_is_full(
    tmp_path, device_room
):
    tracker = ManualTracker()
    hub = TrackerHub(tracker, {"a"})
    w = torch.randn(50_000, 32, device="cuda")
    spec = TableSpec(dim=32, kind=TableKind.PLAIN, num_embeddings=50_000)
    src = RowShardSource("m.a", spec, hub, "a", w, 0)
    cfg = DumperConfig(
        artifacts=str(tmp_path), run="s", snapshot=False, chunk_rows=1000, device_graph_bytes=0
    )  # the exact path: a staging buffer of the rows
    d = Dumper(cfg, [src])
    d.device_budget.fixed = device_room  # 1 KiB: under a chunk, the table goes to host memory
    d.start(step=0)
    ids = torch.randint(0, 50_000, (20_000,), device="cuda")
    tracker.record("a", ids)
    d.dump_now(1)
    keys = torch.unique(ids)
    want = w[keys].cpu().numpy()
    w.add_(1.0)  # the next training step: the dump keeps the rows of step 1
    d.wait_idle(timeout=60)
    stats = d.device_budget.metrics()
    d.close()
    got_keys, got_rows, _, _ = read_dump(ArtifactRoot(str(tmp_path)), "s", 1, 1)["m.a"]
    order = np.argsort(got_keys)
    assert np.array_equal(got_keys[order], keys.cpu().numpy())
    assert np.array_equal(got_rows[order], want)
    assert stats["held_bytes"] == 0
    if device_room is None:
        assert stats["staged"] == 1 and stats["full"] == 0
        assert stats["peak_bytes"] == len(keys) * (32 * 4 + 8)
    elif device_room == 1024:
        assert stats["staged"] == 0 and stats["full"] == 1
    else:  # 6,000 rows staged, the rest gathered into host memory
        assert (stats["staged"], stats["full"], stats["split"]) == (1, 1, 1)
        assert stats["peak_bytes"] == device_room


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


@pytest.mark.parametrize("staging_share", [0.25, 0.0])  # device staging, or straight to host
def test_copies_to_host_reuse_the_pinned_ring_and_every_slot_is_back_after_the_commit(
    tmp_path, staging_share
):
    tracker = ManualTracker()
    hub = TrackerHub(tracker, {"a", "b"})
    ws = {"a": torch.randn(30_000, 16, device="cuda"), "b": torch.randn(5_000, 8, device="cuda")}
    specs = {k: TableSpec(dim=w.shape[1], kind=TableKind.PLAIN, num_embeddings=w.shape[0])
             for k, w in ws.items()}  # fmt: skip
    srcs = [RowShardSource(f"m.{k}", specs[k], hub, k, w, 0) for k, w in ws.items()]
    cfg = DumperConfig(artifacts=str(tmp_path), run="p", every_steps=2, chunk_rows=256,
                       device_staging_share=staging_share, queue_bytes=64 << 20)  # fmt: skip
    d = Dumper(cfg, srcs)
    d.start(step=0)
    ring = d.pinned
    assert ring is not None and ring.allocated and ring.slots >= 2
    want = {}
    for step in range(1, 7):
        for k, w in ws.items():
            ids = torch.randint(0, w.shape[0], (4000,), device="cuda")
            tracker.record(k, ids)
            w.index_add_(0, ids, torch.ones(4000, w.shape[1], device="cuda"))
        if d.maybe_dump(step) is not None:
            want[d._seq] = {f"m.{k}": w.cpu().numpy().copy() for k, w in ws.items()}
    d.wait_idle()
    assert ring.free_slots() == ring.slots and ring.oversize == 0
    root = ArtifactRoot(str(tmp_path))
    for seq, tables in want.items():
        got = read_dump(root, "p", 1, seq)
        assert sum(len(k) for k, *_ in got.values()) > ring.slots * 256  # slots were reused
        for table, (keys, rows, _, _) in got.items():
            assert np.array_equal(rows, tables[table][keys])
    d.close()


@pytest.mark.parametrize("encoder", ["thread", "process"])
def test_dumps_gathered_by_the_graph_hold_the_rows_of_each_dump_step(tmp_path, encoder):
    tracker = ManualTracker()
    ws = {"a": torch.randn(400_000, 16, device="cuda"), "b": torch.randn(3_000, 8, device="cuda")}
    hub = TrackerHub(tracker, set(ws))
    offsets = {"a": 0, "b": 500_000}
    srcs = [
        RowShardSource(
            f"m.{k}",
            TableSpec(dim=w.shape[1], kind=TableKind.PLAIN, num_embeddings=w.shape[0]),
            hub,
            k,
            w,
            offsets[k],
        )
        for k, w in ws.items()
    ]
    limit = 2 * 4096 * (64 + 16) + 3001 + 4096 * (32 + 16)  # 4096 ids per table fit, 8192 not
    cfg = DumperConfig(artifacts=str(tmp_path), run="g", every_steps=3, snapshot=False,
                       chunk_rows=700, encoder=encoder, device_graph_bytes=limit)  # fmt: skip
    d = Dumper(cfg, srcs)
    d.start(step=0)
    graphs = srcs[0].group.graphs if srcs[0].group is not None else None
    assert graphs is not None and graphs.capacity == 4096
    gen = torch.Generator(device="cuda").manual_seed(1)
    want: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    touched = {k: torch.zeros(w.shape[0], dtype=torch.bool, device="cuda") for k, w in ws.items()}
    for step in range(1, 31):
        for k, w in ws.items():
            n = 1500 if step in (16, 17, 18) else 900  # the dump at 18: more than a set holds
            ids = torch.randint(0, w.shape[0], (n,), device="cuda", generator=gen)
            tracker.record(k, ids)
            touched[k][ids] = True
            w.index_add_(0, ids, torch.ones(n, w.shape[1], device="cuda"))
        seq = d.maybe_dump(step)
        if seq is not None:
            want[seq] = {}
            for k, w in ws.items():
                keys = touched[k].nonzero().view(-1)
                want[seq][f"m.{k}"] = ((keys + offsets[k]).cpu().numpy(), w[keys].cpu().numpy())
                touched[k].zero_()
            if seq % 2:
                d.wait_idle()  # a set is free at every dump: the counts below are exact
    d.close()
    assert (graphs.runs, graphs.misses) == (9, 1)
    root = ArtifactRoot(str(tmp_path))
    assert len(want) == 10
    for seq, tables in want.items():
        got = read_dump(root, "g", 1, seq)
        for table, (keys, rows) in tables.items():
            gk, gr, gops, _ = got[table]
            order = np.argsort(gk)
            assert np.array_equal(gk[order], keys) and np.array_equal(gr[order], rows)
            assert not gops.any()


def test_lookups_marked_between_dumps_are_dumped_with_the_rows_of_the_dump_step(tmp_path):
    tracker = ManualTracker()
    ws = {"a": torch.randn(400_000, 16, device="cuda"), "b": torch.randn(3_000, 8, device="cuda")}
    hub = TrackerHub(tracker, set(ws))
    offsets = {"a": 0, "b": 500_000}
    srcs = [
        RowShardSource(
            f"m.{k}",
            TableSpec(dim=w.shape[1], kind=TableKind.PLAIN, num_embeddings=w.shape[0]),
            hub,
            k,
            w,
            offsets[k],
        )
        for k, w in ws.items()
    ]
    limit = 2 * 4096 * (64 + 16) + 3001 + 4096 * (32 + 16)  # 4096 ids per table fit a graph
    cfg = DumperConfig(artifacts=str(tmp_path), run="m", every_steps=40, snapshot=False,
                       chunk_rows=700, device_graph_bytes=limit)  # fmt: skip
    d = Dumper(cfg, srcs)
    d.start(step=0)
    group = srcs[0].group
    assert group is not None and group.graphs is not None and group.graphs.capacity == 4096
    gen = torch.Generator(device="cuda").manual_seed(2)
    want: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    touched = {k: torch.zeros(w.shape[0], dtype=torch.bool, device="cuda") for k, w in ws.items()}
    marked_before_dump = []
    for step in range(1, 101):
        if step == 50:  # evaluation: its lookups are recorded and must not be dumped
            d.before_eval()
            for k, w in ws.items():
                tracker.record(k, torch.randint(0, w.shape[0], (900,), device="cuda"))
            d.after_eval()
        for k, w in ws.items():
            ids = torch.randint(0, w.shape[0], (900,), device="cuda", generator=gen)
            tracker.record(k, ids)
            touched[k][ids] = True
            w.index_add_(0, ids, torch.ones(900, w.shape[1], device="cuda"))
        if step % 40 == 39:
            marked_before_dump.append(list(group.batch.marked))
        seq = d.maybe_dump(step) if step < 100 else d.final_dump(step).seq
        if seq is not None:
            want[seq] = {}
            for k, w in ws.items():
                keys = touched[k].nonzero().view(-1)
                want[seq][f"m.{k}"] = ((keys + offsets[k]).cpu().numpy(), w[keys].cpu().numpy())
                touched[k].zero_()
    d.close()
    # the ids of steps 1-32 and 41-80 were marked as they came, not at the dump step
    assert all(all(n > 0 for n in marked) for marked in marked_before_dump)
    assert len(marked_before_dump) == 2 and group.graphs.runs == 0
    root = ArtifactRoot(str(tmp_path))
    assert sorted(want) == [1, 2, 3]
    for seq, tables in want.items():
        got = read_dump(root, "m", 1, seq)
        for table, (keys, rows) in tables.items():
            gk, gr, _, _ = got[table]
            order = np.argsort(gk)
            assert np.array_equal(gk[order], keys) and np.array_equal(gr[order], rows)
