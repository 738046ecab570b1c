"""End to end: the dumper writes ZCH tables keyed by raw id; the artifacts replay to the model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests._helpers import zch
from tests._helpers.dump import read_dump

from deltarec.artifacts import ArtifactRoot, TableKind
from deltarec.artifacts.lineage import expected_state
from deltarec.dump import Dumper, DumperConfig
from deltarec.testing.multiprocess import run_on_ranks
from deltarec.tracking.discovery import discover_sources
from deltarec.tracking.zch.cpu import prepare_zch_for_training

pytestmark = pytest.mark.multiprocess

BATCH = 48
RUN = "zch"


def _states(dmp: Any, rank: int) -> dict[str, dict[int, np.ndarray]]:
    return {
        table: zch.model_state(mch, weight, offset, with_fallback=rank == 0)
        for table, (mch, weight, offset) in zch.sharded_parts(dmp).items()
    }


def _fallbacks(dmp: Any) -> dict[str, np.ndarray]:
    """This rank's fallback (miss slot) row of each table."""
    out = {}
    for table, (mch, weight, offset) in zch.sharded_parts(dmp).items():
        miss = int(mch._output_global_offset) + int(mch._zch_size) - 1
        out[table] = weight.detach()[miss - offset].numpy().copy()
    return out


def _steps(world_size: int, first: int, last: int) -> set[int]:
    """Every raw id the ranks' batches of steps ``first..last`` looked up (all ranks)."""
    ids: set[int] = set()
    for step in range(first, last + 1):
        for rank in range(world_size):
            ids.update(zch.stream(step - 1, seed=rank + 1, batch=BATCH, halves=2))
    return ids


def _dump_rank(rank: int, world_size: int, root: str, zch_misses: bool = False) -> dict[int, Any]:
    dmp, opt = zch.build_sharded(world_size)
    prepare_zch_for_training(dmp, max_ids_per_step=BATCH * world_size)
    config = DumperConfig(
        artifacts=root, run=RUN, every_steps=3, chunk_rows=5, fsync=False, zch_misses=zch_misses
    )
    dumper = Dumper(config, discover_sources(dmp))
    dumper.start(step=0)
    states = {0: _states(dmp, rank)}
    fallbacks = {0: _fallbacks(dmp)}
    for step in range(1, 10):
        zch.train_step(dmp, opt, zch.stream(step - 1, seed=rank + 1, batch=BATCH, halves=2))
        seq = dumper.maybe_dump(step)
        if seq is not None:
            states[seq] = _states(dmp, rank)
            fallbacks[seq] = _fallbacks(dmp)
    zch.train_step(dmp, opt, zch.stream(9, seed=rank + 1, batch=BATCH, halves=2))
    final = dumper.final_dump(10)
    states[final.seq] = _states(dmp, rank)
    fallbacks[final.seq] = _fallbacks(dmp)
    dumper.close()
    mch = zch.sharded_parts(dmp)["mc_ebc.bag"][0]
    assert "remap" not in mch.__dict__  # the dumper closed the ZCH sources
    return {"states": states, "fallbacks": fallbacks} if zch_misses else states


def test_ids_not_held_are_dumped_once_with_the_fallback_row_of_the_rank_they_route_to(
    tmp_path: Path,
) -> None:
    per_rank = run_on_ranks(_dump_rank, 2, args=(str(tmp_path), True), timeout_s=240)
    root = ArtifactRoot(str(tmp_path))
    assert root.list_dumps(RUN, 1) == [0, 1, 2, 3, 4]
    # dump 1..3 every 3 steps, the final one after step 10
    intervals = {1: (1, 3), 2: (4, 6), 3: (7, 9), 4: (10, 10)}
    misses_seen = 0
    for seq, (first, last) in intervals.items():
        got = read_dump(root, RUN, 1, seq)
        for table in ("mc_ebc.bag", "mc_ec.seq"):
            held_before = set(per_rank[0]["states"][seq - 1][table]) | set(
                per_rank[1]["states"][seq - 1][table]
            )
            held = set(per_rank[0]["states"][seq][table]) | set(per_rank[1]["states"][seq][table])
            keys, rows, ops, _ = got[table]
            assert len(set(keys.tolist())) == len(keys), "a key written twice in one dump"
            evicted = dict(zip(keys[ops == 1].tolist(), rows[ops == 1], strict=True))
            # Eviction every step: an id admitted in the interval was looked up in it.
            looked_up = _steps(2, first, last)
            assert set(evicted) == (looked_up | held_before) - held - {-1}
            misses_seen += len(looked_up - held_before - held)
            for key, row in evicted.items():
                owner = 1 if key >= 500_000 else 0
                want = per_rank[owner]["fallbacks"][seq][table]
                np.testing.assert_array_equal(row, want, err_msg=f"{table} dump {seq} key {key}")
    assert misses_seen > 0, "no id was looked up without being held"


def test_every_dump_of_a_sharded_zch_model_replays_to_the_model_state(tmp_path: Path) -> None:
    per_rank = run_on_ranks(_dump_rank, 2, args=(str(tmp_path),), timeout_s=240)
    root = ArtifactRoot(str(tmp_path))
    info = root.read_generation(RUN, 1)
    assert {t: s.kind for t, s in info.tables.items()} == {
        "mc_ebc.bag": TableKind.ZCH,
        "mc_ec.seq": TableKind.ZCH,
    }
    seqs = root.list_dumps(RUN, 1)
    assert seqs == sorted(per_rank[0]) == [0, 1, 2, 3, 4]
    evicted_seen = 0
    for seq in seqs:
        expected = expected_state(root, RUN, 1, through_seq=seq)
        for table, want0 in per_rank[0][seq].items():
            want1 = per_rank[1][seq][table]
            assert not set(want0) & set(want1)
            exp = expected.tables[table]
            keys = exp.present_keys()
            got = dict(zip(keys.tolist(), exp.load(keys), strict=True))
            zch.assert_same_state(got, {**want0, **want1})
            evicted_seen += int((exp.ops == 1).sum())
    assert evicted_seen > 0
