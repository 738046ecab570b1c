"""The team's training program: ``dlrm_team.train:main``, run by the pipeline on every rank.

Everything deltarec needs comes from the ``DELTAREC_*`` environment the pipeline's train step
sets (``TrainSettings.from_env()``); the program's own flags come after the entry point
(the pipeline's ``train_extra_args``)::

    --batch-size N   samples per rank per step (default 64)
    --export DIR     write every rank's final table shards to DIR/rank-<r>.npz
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from deltarec.api import TrainSettings, hook_from_env
from dlrm_team.data import make_batch
from dlrm_team.model import build, is_embedding


def export_shards(dmp: torch.nn.Module, directory: str, rank: int) -> str:
    """Write this rank's shards of every embedding table: ``<key>@<row>,<col>`` -> rows."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out: dict[str, np.ndarray] = {}
    for key, value in dmp.state_dict().items():
        if not is_embedding(key):
            continue
        if isinstance(value, ShardedTensor):
            for shard in value.local_shards():
                row, col = shard.metadata.shard_offsets
                out[f"{key}@{row},{col}"] = shard.tensor.detach().numpy()
        elif rank == 0:
            out[f"{key}@0,0"] = value.detach().numpy()
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"rank-{rank}.npz")
    np.savez(path, **out)
    return path


def train_steps(
    dmp: torch.nn.Module,
    dense_optimizer: torch.optim.Optimizer,
    hook: Any,
    rank: int,
    steps: int,
    batch_size: int,
) -> torch.Tensor:
    """Train steps ``1..steps`` on this rank's batches; return the last step's loss.

    The caller has started ``hook``; it is told after each step and at the end.
    """
    loss = torch.zeros(())
    for step in range(1, steps + 1):
        batch = make_batch(step, rank, batch_size)
        loss = dmp(batch.dense, batch.sparse, batch.seq, batch.labels)
        dense_optimizer.zero_grad()
        loss.backward()
        dense_optimizer.step()
        hook.after_step(step)
    hook.on_end(steps)
    return loss


def main(argv: Sequence[str] | None = None) -> int:
    """Train the DLRM for ``DELTAREC_STEPS`` steps with delta dumps; returns the exit code."""
    parser = argparse.ArgumentParser(prog="dlrm_team.train")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--export", default=None)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    settings = TrainSettings.from_env()
    steps = settings.steps or 100

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    device = torch.device("cpu")
    dmp, dense_optimizer = build(device)

    hook = hook_from_env()
    try:
        hook.on_start(dmp, step=0, restored_from=None)
        loss = train_steps(dmp, dense_optimizer, hook, rank, steps, args.batch_size)
        if args.export:
            export_shards(dmp, args.export, rank)
        if rank == 0:
            print(f"dlrm_team: trained {steps} steps, last loss {loss.item():.4f}", flush=True)
    finally:
        hook.close()
        dist.destroy_process_group()
    return 0
