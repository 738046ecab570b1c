"""Column-wise and data-parallel tables on 2 CPU ranks: local parts, assembled by the worker.

Plain torch tables driven by hand (no torchrec), small chunks so that the ranks have different
numbers of parts (several exchange rounds, a rank padding the rounds it has no rows for).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests._helpers.dump import read_dump

from deltarec.artifacts import ArtifactRoot, TableKind, TableSpec
from deltarec.testing.multiprocess import run_on_ranks

pytestmark = pytest.mark.multiprocess

DIM = 8


def _sources(rank: int, full: torch.Tensor, tracker_fqns: set[str]):
    from deltarec.tracking.plain import ColumnShard, ColumnShardSource, ReplicatedSource
    from deltarec.tracking.tracker import ManualTracker, TrackerHub

    tracker = ManualTracker()
    hub = TrackerHub(tracker, tracker_fqns)
    spec = TableSpec(dim=DIM, kind=TableKind.PLAIN, num_embeddings=full.shape[0])
    # rank 0 holds two column blocks (0:2 and 4:8), rank 1 the block between them
    blocks = [(0, 2), (4, 8)] if rank == 0 else [(2, 4)]
    cols = [ColumnShard(a, full[:, a:b].clone()) for a, b in blocks]
    dp = full.clone()
    sources = [
        ReplicatedSource("m.dp", spec, hub, "dp", dp),
        ColumnShardSource("m.cw", spec, hub, "cw", cols, writer_rank=1),
    ]
    return tracker, sources, dp, cols


def _uneven_parts(rank: int, world_size: int, tmp: str) -> dict:
    from deltarec.dump import Dumper, DumperConfig

    full = torch.randn(1000, DIM, generator=torch.Generator().manual_seed(0))
    tracker, sources, dp, cols = _sources(rank, full, {"dp", "cw"})
    d = Dumper(DumperConfig(artifacts=tmp, run="a", snapshot=True, chunk_rows=64), sources)
    d.start(step=0)
    # rank 0: 300 ids (5 parts), rank 1: 40 ids (1 part); they overlap at 280-299
    mine = torch.arange(0, 300) if rank == 0 else torch.arange(280, 320)
    tracker.record("dp", mine)
    tracker.record("cw", torch.arange(100, 400))  # every column holder sees the same ids
    dp[0:320] += 1.0  # replicas stay equal: every rank applies the same (all-reduced) update
    for c in cols:
        c.tensor[100:400] += 2.0
    at_dump = {"dp": dp.clone(), "cw": torch.cat([c.tensor for c in cols], 1).clone()}
    seq = d.dump_now(1)
    dp.add_(100.0)  # training goes on: the dump must keep the values of its step
    for c in cols:
        c.tensor.add_(100.0)
    d.wait_idle()
    final = d.final_dump(2)  # nothing touched: empty parts on both ranks
    d.close()
    return {"seq": seq, "final": final.seq, "dp": at_dump["dp"].numpy(), "blocks": at_dump["cw"]}


def test_uneven_parts_are_assembled_into_one_row_per_key_with_the_dump_step_values(tmp_path):
    res = run_on_ranks(_uneven_parts, 2, args=(str(tmp_path),), timeout_s=180)
    root = ArtifactRoot(str(tmp_path))
    full = torch.randn(1000, DIM, generator=torch.Generator().manual_seed(0)).numpy()

    snap = read_dump(root, "a", 1, 0)
    for table in ("m.dp", "m.cw"):
        keys, rows, _, _ = snap[table]
        assert np.array_equal(np.sort(keys), np.arange(1000)), table
        assert np.array_equal(rows[np.argsort(keys)], full), table

    got = read_dump(root, "a", 1, res[0]["seq"])
    keys, rows, ops, steps = got["m.dp"]
    assert len(keys) == len(np.unique(keys)) == 320
    assert np.array_equal(np.sort(keys), np.arange(320))
    assert np.array_equal(rows[np.argsort(keys)], res[0]["dp"][:320])
    assert not ops.any() and (steps == 1).all()

    keys, rows, _, _ = got["m.cw"]
    assert np.array_equal(np.sort(keys), np.arange(100, 400))
    want = full[100:400] + 2.0
    assert np.array_equal(rows[np.argsort(keys)], want)

    m = root.read_manifest("a", 1, res[0]["seq"])
    assert {(s.table, s.rank) for s in m.shards} == {("m.dp", 0), ("m.cw", 1)}
    assert root.read_manifest("a", 1, res[0]["final"]).tables == {"m.dp": 0, "m.cw": 0}


def _different_column_ids(rank: int, world_size: int, tmp: str) -> str:
    from deltarec.dump import Dumper, DumperConfig
    from deltarec.errors import DumpError

    full = torch.randn(100, DIM, generator=torch.Generator().manual_seed(0))
    tracker, sources, _, _ = _sources(rank, full, {"dp", "cw"})
    d = Dumper(DumperConfig(artifacts=tmp, run="b", snapshot=False), sources)
    d.start(step=0)
    tracker.record("cw", torch.arange(0, 10 + rank))
    try:
        d.final_dump(1, timeout=60)
    except DumpError as e:
        return str(e)
    finally:
        d.close()
    return "no error"


def test_column_holders_with_different_ids_fail_the_dump_on_every_rank(tmp_path):
    res = run_on_ranks(_different_column_ids, 2, args=(str(tmp_path),), timeout_s=180)
    for message in res:
        assert "m.cw" in message and "different ids" in message, message
    assert ArtifactRoot(str(tmp_path)).list_dumps("b", 1) == []  # no manifest was written
