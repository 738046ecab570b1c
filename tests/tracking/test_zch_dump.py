"""End to end: the dumper writes ZCH tables keyed by raw id; the artifacts replay to the model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests._helpers.zch import (
    assert_same_state,
    build_sharded,
    model_state,
    sharded_parts,
    stream,
    train_step,
)

from deltarec.artifacts import ArtifactRoot, TableKind
from deltarec.artifacts.lineage import expected_state
from deltarec.dump import Dumper, DumperConfig
from deltarec.testing.multiprocess import run_on_ranks
from deltarec.tracking.discovery import discover_sources
from deltarec.tracking.zch_cpu import prepare_zch_for_training

pytestmark = pytest.mark.multiprocess

BATCH = 48
RUN = "zch"


def _states(dmp: Any, rank: int) -> dict[str, dict[int, np.ndarray]]:
    return {
        table: model_state(mch, weight, offset, with_fallback=rank == 0)
        for table, (mch, weight, offset) in sharded_parts(dmp).items()
    }


def _dump_rank(rank: int, world_size: int, root: str) -> dict[int, Any]:
    dmp, opt = build_sharded(world_size)
    prepare_zch_for_training(dmp, max_ids_per_step=BATCH * world_size)
    config = DumperConfig(artifacts=root, run=RUN, every_steps=3, chunk_rows=5, fsync=False)
    dumper = Dumper(config, discover_sources(dmp))
    dumper.start(step=0)
    states = {0: _states(dmp, rank)}
    for step in range(1, 10):
        train_step(dmp, opt, stream(step - 1, seed=rank + 1, batch=BATCH, halves=2))
        seq = dumper.maybe_dump(step)
        if seq is not None:
            states[seq] = _states(dmp, rank)
    train_step(dmp, opt, stream(9, seed=rank + 1, batch=BATCH, halves=2))
    final = dumper.final_dump(10)
    states[final.seq] = _states(dmp, rank)
    dumper.close()
    mch = sharded_parts(dmp)["mc_ebc.bag"][0]
    assert "remap" not in mch.__dict__  # the dumper closed the ZCH sources
    return states


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
            assert_same_state(got, {**want0, **want1})
            evicted_seen += int((exp.ops == 1).sum())
    assert evicted_seen > 0
