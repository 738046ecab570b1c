"""ZCH table sources on a 2-rank row-wise sharded DMP model (gloo, CPU, fused RowWiseAdagrad)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from tests._helpers.zch import (
    SHARDED_ZCH,
    apply,
    assert_same_state,
    build_sharded,
    model_state,
    sharded_parts,
    stream,
    train_step,
)

from deltarec.testing.multiprocess import run_on_ranks
from deltarec.tracking.zch import (
    ZchRowRangeError,
    ZchTableSource,
    discover_zch_sources,
    zch_embedding_fqns,
)
from deltarec.tracking.zch.cpu import prepare_zch_for_training

pytestmark = pytest.mark.multiprocess

BATCH = 48


def _per_rank(rank: int, world_size: int) -> dict[str, Any]:
    dmp, opt = build_sharded(world_size)
    fixes = prepare_zch_for_training(dmp, max_ids_per_step=BATCH * world_size)
    sources = {s.table_id: s for s in discover_zch_sources(dmp)}
    assert all(isinstance(s, ZchTableSource) for s in sources.values())
    replay: dict[str, dict[int, np.ndarray]] = {t: {} for t in sources}
    evictions: dict[str, list[int]] = {t: [] for t in sources}
    step = 0
    for _interval in range(4):
        for _ in range(3):
            train_step(dmp, opt, stream(step, seed=rank + 1, batch=BATCH, halves=2))
            step += 1
        for table, source in sources.items():
            counts = apply(replay[table], source.collect())
            evictions[table].append(counts["evicted"])
            mch, weight, offset = sharded_parts(dmp)[table]
            want = model_state(mch, weight, offset, with_fallback=rank == 0)
            assert_same_state(replay[table], want)
    out: dict[str, Any] = {
        "fixes": fixes,
        "fqns": sorted(zch_embedding_fqns(dmp)),
        "specs": {t: s.spec.to_json() for t, s in sources.items()},
        "evictions": evictions,
        "held": {t: sorted(k for k in replay[t] if k != -1) for t in sources},
        "fallback_dumped": {t: -1 in replay[t] for t in sources},
    }
    out["read_keys"] = _check_read_keys(dmp, sources, out["held"])
    out["snapshot_ok"] = _check_snapshot(dmp, sources, rank)
    out["range_error"] = _check_out_of_range(dmp, opt, rank)
    for source in sources.values():
        source.close()
    return out


def _check_read_keys(dmp: Any, sources: dict, held: dict[str, list[int]]) -> dict[str, Any]:
    everyone: list[Any] = [None, None]
    dist.all_gather_object(everyone, held)
    result = {}
    for table, source in sources.items():
        keys = sorted({k for h in everyone for k in h[table]} | {-1, 1, 999_999})
        got = source.read_keys(torch.tensor(keys))
        result[table] = {
            "keys": got.keys.tolist(),
            "ops": got.ops.tolist(),
        }
    return result


def _check_snapshot(dmp: Any, sources: dict, rank: int) -> bool:
    for table, source in sources.items():
        snap: dict[int, np.ndarray] = {}
        for chunk in source.snapshot(chunk_rows=3):
            apply(snap, chunk)
        mch, weight, offset = sharded_parts(dmp)[table]
        assert_same_state(snap, model_state(mch, weight, offset, with_fallback=rank == 0))
    return True


def _check_out_of_range(dmp: Any, opt: torch.optim.Optimizer, rank: int) -> str:
    mch, _, offset = sharded_parts(dmp)["mc_ebc.bag"]
    held = mch._mch_sorted_raw_ids[:-1]
    victim = int(held[0])  # the smallest raw id held by this rank's shard
    mch._mch_remapped_ids_mapping[0] = offset + 100
    victims: list[Any] = [None, None]
    dist.all_gather_object(victims, victim)
    try:
        train_step(dmp, opt, victims * 4)
    except ZchRowRangeError as e:
        assert e.table == "mc_ebc.bag" and e.rows == [offset + 100]
        return str(e)
    return "no error"


def test_two_rank_row_wise_collects_replay_to_each_rank_state_with_raw_ids() -> None:
    results = run_on_ranks(_per_rank, 2, timeout_s=240)
    r0, r1 = results
    for r in results:
        assert r["fixes"]["history_presized"] == 2
        assert r["fixes"]["cpu_reset_installed"] >= 1
        for table, counts in r["evictions"].items():
            assert all(c > 0 for c in counts), f"{table}: an interval without evictions {counts}"
    assert r0["specs"]["mc_ebc.bag"] == {
        "dim": 4,
        "dtype": "float32",
        "kind": "zch",
        "num_embeddings": SHARDED_ZCH,
        "zch_size": SHARDED_ZCH,
        "sharding": "row_wise",
        "module_type": "EmbeddingBagCollection",
    }
    assert r0["specs"] == r1["specs"]
    assert r0["fqns"] == r1["fqns"] and "mc_ebc._embedding_module.embedding_bags.bag" in r0["fqns"]
    for table in ("mc_ebc.bag", "mc_ec.seq"):
        assert r0["fallback_dumped"][table] and not r1["fallback_dumped"][table]
        h0, h1 = set(r0["held"][table]), set(r1["held"][table])
        assert h0 and h1 and not h0 & h1
        assert all(k < 500_000 for k in h0) and all(k >= 500_000 for k in h1)
        k0, k1 = r0["read_keys"][table], r1["read_keys"][table]
        assert not set(k0["keys"]) & set(k1["keys"])  # each key answered by one rank
        assert dict(zip(k0["keys"], k0["ops"], strict=True)) == {-1: 0, 1: 1, **{k: 0 for k in h0}}
        assert dict(zip(k1["keys"], k1["ops"], strict=True)) == {999_999: 1, **{k: 0 for k in h1}}
    for r in results:
        assert r["snapshot_ok"]
        assert "'mc_ebc.bag'" in r["range_error"] and "outside" in r["range_error"]
