"""Two gloo ranks train the example model, checkpoint, resume and export (one spawn)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist

from deltarec.model import model_tables, tiny_model_config
from deltarec.testing.multiprocess import run_on_ranks, spawn_ranks

pytestmark = pytest.mark.multiprocess

_EMPTY = torch.iinfo(torch.int64).max


def _local_state(sm: Any) -> dict[str, torch.Tensor]:
    """This rank's shards of every sparse entry of the state dict (tables and MCH buffers)."""
    out = {}
    for key, value in sm.dmp.state_dict().items():
        if not key.startswith("sparse."):
            continue
        if hasattr(value, "local_shards"):
            for shard in value.local_shards():
                offsets = tuple(shard.metadata.shard_offsets)
                out[f"{key}@{offsets}"] = shard.tensor.detach().clone()
        else:
            out[key] = value.detach().clone()
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class _RecordingHook:
    """Records calls; snapshots the model at step ``snap_step``, before and after each eval."""

    def __init__(self, sm: Any, snap_step: int) -> None:
        self.sm, self.snap_step = sm, snap_step
        self.calls: list[str] = []
        self.snapshot: dict[str, torch.Tensor] | None = None
        self.at_start: dict[str, torch.Tensor] | None = None
        self.eval_unchanged: list[bool] = []
        self._before_eval: dict[str, torch.Tensor] = {}
        self.state: dict[str, Any] = {"tag": "fresh"}
        self.closed = False

    def on_start(self, model: Any, step: int, restored_from: int | None) -> None:
        self.calls.append(f"start:{step}:{restored_from}")
        self.at_start = _local_state(self.sm)

    def after_step(self, step: int) -> None:
        self.state = {"tag": f"rank{dist.get_rank()}-step{step}"}
        if step == self.snap_step:
            self.snapshot = _local_state(self.sm)

    def before_eval(self) -> None:
        self.calls.append("before_eval")
        self._before_eval = _local_state(self.sm)

    def after_eval(self) -> None:
        self.calls.append("after_eval")
        self.eval_unchanged.append(_same(self._before_eval, _local_state(self.sm)))

    def on_end(self, step: int) -> None:
        self.calls.append(f"end:{step}")

    def close(self) -> None:
        self.closed = True

    def before_checkpoint(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls.append(f"load:{state['tag']}")
        self.state = dict(state)


def _read_export(path: Path) -> tuple[np.ndarray, np.ndarray]:
    t = pq.read_table(path)
    assert t.column_names == ["key", "embedding"]
    keys = t.column("key").to_numpy()
    dim = t.schema.field("embedding").type.list_size
    rows = t.column("embedding").combine_chunks().flatten().to_numpy().reshape(-1, dim)
    return keys, rows


def _check_export_against_shards(sm: Any, export_dir: Path) -> dict[str, Any]:
    """Compare every exported table with this rank's shards; returns facts for the parent."""
    sd = sm.dmp.state_dict()
    facts: dict[str, Any] = {"tables": {}}
    for t in sm.tables:
        keys, rows = _read_export(export_dir / f"{t.table_id}.parquet")
        value = sd[t.weight_key]
        if t.kind == "plain":
            assert rows.shape == (t.num_embeddings, t.dim), t.table_id
            assert np.array_equal(keys, np.arange(t.num_embeddings)), t.table_id
            shards = (
                [(s.metadata.shard_offsets, s.tensor) for s in value.local_shards()]
                if hasattr(value, "local_shards")
                else [([0, 0], value)]
            )
            for (r0, c0), tensor in shards:
                n, m = tensor.shape
                assert np.array_equal(rows[r0 : r0 + n, c0 : c0 + m], tensor.numpy()), t.table_id
            facts["tables"][t.table_id] = [
                tuple(int(x) for x in tensor.shape) for _, tensor in shards
            ]
            continue
        (shard,) = value.local_shards()
        offset = shard.metadata.shard_offsets[0]
        mch = sm.mch_modules()[t.table_id]
        raw = mch._mch_sorted_raw_ids[:-1]
        slots = mch._mch_remapped_ids_mapping[:-1]
        held = raw != _EMPTY
        index = {int(k): i for i, k in enumerate(keys)}
        for raw_id, slot in zip(raw[held].tolist(), slots[held].tolist(), strict=True):
            assert np.array_equal(rows[index[raw_id]], shard.tensor[slot - offset].numpy())
        if dist.get_rank() == 0:
            miss = mch._zch_size - 1
            assert np.array_equal(rows[index[-1]], shard.tensor[miss].numpy())
        facts["zch_held"] = sorted(raw[held].tolist())
        facts["zch_keys"] = keys.tolist()
        facts["zch_slots"] = t.num_embeddings
    return facts


def _train_checkpoint_resume_export(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    from deltarec.model import build_sharded_model, tiny_model_config
    from deltarec.train import TrainConfig, run_training

    model = tiny_model_config()
    base = {"model": model, "batch_size": 32, "workdir": workdir, "log_every": 1000}
    cfg1 = TrainConfig(
        **base,
        steps=200,
        checkpoint_every=100,
        eval_every=50,
        eval_batches=2,
        export_tables=f"{workdir}/export",
    )
    sm1 = build_sharded_model(model, torch.device("cpu"), max_batch_size=32)
    hook1 = _RecordingHook(sm1, snap_step=100)
    first = run_training(cfg1, hooks=[hook1], model=sm1)
    facts = _check_export_against_shards(sm1, Path(workdir) / "export")

    cfg2 = TrainConfig(**base, steps=240, resume_step=100, checkpoint_at_end=False)
    sm2 = build_sharded_model(model, torch.device("cpu"), max_batch_size=32)
    hook2 = _RecordingHook(sm2, snap_step=-1)
    second = run_training(cfg2, hooks=[hook2], model=sm2)
    assert hook1.snapshot is not None and hook2.at_start is not None
    # newest complete checkpoint is step 200 (step 240 was not saved); nothing left to train
    sm3 = build_sharded_model(model, torch.device("cpu"), max_batch_size=32)
    third = run_training(TrainConfig(**base, steps=200), model=sm3)
    return {
        "first": (first.start_step, first.step, first.checkpoints, first.restored_from),
        "first_evals": [s for s, _ in first.eval_losses],
        "first_loss_finite": bool(np.isfinite(first.last_loss or float("nan"))),
        "exported": first.exported,
        "hook1_calls": hook1.calls,
        "hook1_closed": hook1.closed,
        "eval_unchanged": hook1.eval_unchanged,
        "second": (second.start_step, second.step, second.restored_from),
        "hook2_calls": hook2.calls,
        "third": (third.start_step, third.step, third.restored_from, third.checkpoints),
        "third_equals_end_of_first": _same(_local_state(sm1), _local_state(sm3)),
        "resumed_weights_equal_saved": _same(hook1.snapshot, hook2.at_start),
        "resumed_differs_from_end_of_first": not _same(_local_state(sm1), hook2.at_start),
        **facts,
    }


def test_two_ranks_train_checkpoint_resume_and_export_whole_tables(tmp_path):
    results = run_on_ranks(_train_checkpoint_resume_export, 2, args=(str(tmp_path),))
    r0, r1 = results
    for r, res in enumerate(results):
        # trained, checkpointed at 100 and 200, evaluated at 50..200 without changing the model
        assert res["first"] == (0, 200, [100, 200], None)
        assert res["first_evals"] == [50, 100, 150, 200]
        assert res["first_loss_finite"]
        assert res["eval_unchanged"] == [True] * 4
        assert res["hook1_calls"][0] == "start:0:None" and res["hook1_calls"][-1] == "end:200"
        assert res["hook1_calls"].count("before_eval") == 4 and res["hook1_closed"]
        # resumed from step 100 with the step-100 weights, MCH buffers and this rank's hook state
        assert res["second"] == (100, 240, 100)
        assert res["hook2_calls"][:2] == [f"load:rank{r}-step100", "start:100:100"]
        assert res["resumed_weights_equal_saved"]
        assert res["resumed_differs_from_end_of_first"]
        # resumed from the newest (200) with nothing to do: no step, no re-saved checkpoint
        assert res["third"] == (200, 200, 200, [])
        assert res["third_equals_end_of_first"]
    assert (tmp_path / "checkpoints" / "step-00000100" / "COMPLETE").is_file()
    assert (tmp_path / "checkpoints" / "step-00000200" / "COMPLETE").is_file()
    assert not (tmp_path / "checkpoints" / "step-00000240").exists()
    # every table exported by rank 0; shards of row-wise / column-wise tables came out whole
    assert r0["exported"]["sparse.ebc.item_id"] == 400 and r1["exported"] == {}
    # the table ids themselves are frozen by test_model_data.py
    assert set(r0["exported"]) == {t.table_id for t in model_tables(tiny_model_config(), 2)}
    assert r0["tables"]["sparse.ebc.query"] == [(200, 16)] == r1["tables"]["sparse.ebc.query"]
    assert r0["tables"]["sparse.ebc.item_id"] == [(200, 16)] == r1["tables"]["sparse.ebc.item_id"]
    assert (
        r0["tables"]["sparse.ebc.user_id"] == [(300, 16)]
        and r1["tables"]["sparse.ebc.user_id"] == []
    )
    # ZCH: keys are the raw ids both MCH shards hold (full: 31 per shard), plus -1 (fallback)
    held = sorted(r0["zch_held"] + r1["zch_held"])
    assert len(r0["zch_held"]) == len(r1["zch_held"]) == 31
    assert r0["zch_keys"] == [-1, *held]
    assert max(held) > 10 * r0["zch_slots"]  # raw ids, not slots
    assert max(r0["zch_held"]) < 50_000 <= min(r1["zch_held"])  # routed by raw-id range


class _CountingHook:
    def __init__(self) -> None:
        self.steps: list[int] = []
        self.closed = False

    def on_start(self, model: Any, step: int, restored_from: int | None) -> None: ...
    def after_step(self, step: int) -> None:
        self.steps.append(step)

    def before_eval(self) -> None: ...
    def after_eval(self) -> None: ...
    def before_checkpoint(self) -> None: ...
    def on_end(self, step: int) -> None: ...
    def close(self) -> None:
        self.closed = True

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _exhaust(rank: int, world_size: int) -> dict[str, Any]:
    from deltarec.model import DataConfig, tiny_model_config
    from deltarec.train import DataExhaustedError, TrainConfig, run_training

    model = tiny_model_config()
    even = run_training(
        TrainConfig(model=model, batch_size=8, steps=50, data=DataConfig(batches_per_rank=6))
    )
    hook = _CountingHook()
    uneven = TrainConfig(
        model=model, batch_size=8, steps=50, data=DataConfig(batches_by_rank={1: 4})
    )
    try:
        run_training(uneven, hooks=[hook])
        raise AssertionError("uneven data did not raise")
    except DataExhaustedError as e:
        facts = {
            "even": (even.step, even.data_exhausted),
            "error": (e.step, e.exhausted_ranks, str(e)),
            "hook": (hook.steps, hook.closed),
        }
    # Fused RowWiseAdagrad on the ZCH table: fbgemm's eviction reset has no CPU kernel, so
    # without the reset build_sharded_model installs, this fails at the first MCH admission
    # (within these 20 steps: NotImplementedError, reset_weight_momentum).
    rowwise = tiny_model_config(zch_optimizer="rowwise_adagrad")
    facts["rowwise_zch"] = run_training(TrainConfig(model=rowwise, batch_size=8, steps=20)).step
    return facts


def test_uneven_data_exhaustion_fails_on_every_rank_and_even_exhaustion_ends_the_run():
    """Also trains fused RowWiseAdagrad on the ZCH table on CPU (with the eviction reset)."""
    outcomes = spawn_ranks(_exhaust, 2)
    assert all(o.ok for o in outcomes), [o.traceback for o in outcomes]
    for o in outcomes:
        assert o.value["even"] == (6, True)
        step, ranks, message = o.value["error"]
        assert (step, ranks) == (5, [1])
        assert "step 5" in message and "rank(s) 1 of 2" in message
        assert o.value["hook"] == ([1, 2, 3, 4], True)
        assert o.value["rowwise_zch"] == 20
