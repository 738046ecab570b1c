"""The example model's ZCH table through training, checkpoint, restore and republish (2 ranks).

After a restore, the new generation's republish dump must bring serving back to the restored
model: ids admitted after the checkpoint come back as ``op = 1``, ids evicted after it come
back with their restored rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests._helpers.train import tiny_train_config
from tests._helpers.zch import assert_same_state, model_state

from deltarec.artifacts import ArtifactRoot, Parent
from deltarec.artifacts.lineage import expected_state
from deltarec.testing.multiprocess import run_on_ranks

pytestmark = pytest.mark.multiprocess

TABLE = "sparse.zch.ad_id"
RUN = "zch"
CKPT = 8
BATCH = 16


class _Probe:
    """A hook after the dump hook: the ZCH state at start (after a restore) and at the end."""

    def __init__(self, sm: Any) -> None:
        self.sm = sm
        self.states: dict[str, dict[int, np.ndarray]] = {}

    def _read(self, when: str) -> None:
        from deltarec.tracking.zch import find_zch_tables

        (t,) = find_zch_tables(self.sm.dmp)
        self.states[when] = model_state(t.mch, t.weight(), t.row_offset, t.rank == 0)

    def on_start(self, model: Any, step: int, restored_from: int | None) -> None:
        self._read("start")

    def on_end(self, step: int) -> None:
        self._read("end")

    def after_step(self, step: int) -> None:
        pass

    def before_eval(self) -> None:
        pass

    def after_eval(self) -> None:
        pass

    def close(self) -> None:
        pass

    def before_checkpoint(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _train(tmp: str, steps: int, resume_step: int | None) -> dict[str, Any]:
    import torch

    from deltarec.dump import make_train_hook
    from deltarec.model.sharding import build_sharded_model
    from deltarec.train import run_training

    config = tiny_train_config(
        tmp, steps=steps, batch_size=BATCH, checkpoint_every=CKPT, resume_step=resume_step
    )
    sm = build_sharded_model(config.model, torch.device("cpu"), seed=0, max_batch_size=BATCH)
    hook = make_train_hook(artifacts=f"{tmp}/art", run=RUN, every_steps=3)
    probe = _Probe(sm)
    run_training(config, hooks=[hook, probe], model=sm)
    return probe.states


def _restore_rank(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    first = _train(tmp, steps=16, resume_step=None)
    second = _train(tmp, steps=18, resume_step=CKPT)
    return {"first_end": first["end"], "restored": second["start"], "second_end": second["end"]}


def _serving(root: ArtifactRoot, generation: int, through_seq: int | None) -> dict:
    table = expected_state(root, RUN, generation, through_seq).tables[TABLE]
    keys = table.present_keys()
    return dict(zip(keys.tolist(), table.load(keys), strict=True))


def test_restore_republishes_zch_ids_so_serving_equals_the_restored_model(tmp_path: Path) -> None:
    r0, r1 = run_on_ranks(_restore_rank, 2, args=(str(tmp_path),), timeout_s=300)
    root = ArtifactRoot(str(tmp_path / "art"))
    assert root.read_generation(RUN, 2).parent == Parent(1, CKPT)
    # generation 1, all dumps: serving equals the model at the end of the first run
    assert_same_state(_serving(root, 1, None), {**r0["first_end"], **r1["first_end"]})
    # generation 2, through its republish dump (seq 1): serving equals the restored model
    restored = {**r0["restored"], **r1["restored"]}
    assert_same_state(_serving(root, 2, 1), restored)
    republish = expected_state(root, RUN, 2, 1)
    gen1_end = {**r0["first_end"], **r1["first_end"]}
    admitted_after_ckpt = set(gen1_end) - set(restored)
    evicted_after_ckpt = set(restored) - set(gen1_end)
    assert admitted_after_ckpt and evicted_after_ckpt  # the restore undid both kinds of change
    table = republish.tables[TABLE]
    absent = set(table.keys[table.ops == 1].tolist())
    assert admitted_after_ckpt <= absent
    # generation 2, all dumps: serving equals the model at the end of the second run
    assert_same_state(_serving(root, 2, None), {**r0["second_end"], **r1["second_end"]})
