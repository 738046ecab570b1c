"""The CUDA path (nccl): skipped here, where torch is the CPU build."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deltarec.testing.multiprocess import run_on_ranks

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.multiprocess,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs CUDA and the CUDA fbgemm-gpu; on CPU RowWiseAdagrad on the ZCH table "
        "fails (fbgemm::reset_weight_momentum has no CPU kernel, see test_train_multirank)",
    ),
]


def _train_on_cuda(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    from deltarec.model import tiny_model_config
    from deltarec.train import TrainConfig, run_training

    cfg = TrainConfig(
        model=tiny_model_config(zch_optimizer="rowwise_adagrad"),
        device="cuda",
        steps=40,
        batch_size=32,
        workdir=workdir,
        checkpoint_every=20,
        eval_every=20,
        export_tables=f"{workdir}/export",
    )
    result = run_training(cfg)
    return {"step": result.step, "exported": result.exported, "evals": len(result.eval_losses)}


def test_every_sharding_type_and_rowwise_adagrad_zch_train_on_cuda(tmp_path):
    world = min(2, torch.cuda.device_count())
    results = run_on_ranks(_train_on_cuda, world, args=(str(tmp_path),), backend="nccl")
    assert all(r["step"] == 40 and r["evals"] == 2 for r in results)
    assert len(results[0]["exported"]) == 7
