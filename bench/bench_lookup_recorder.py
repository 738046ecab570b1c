"""Step time of a module recorded by deltarec's own recorder vs by torchrec's tracker, 2 CPU ranks.

Each rank builds the same EmbeddingBagCollection model twice (4 tables x 10k rows x dim 16,
two table-wise, two row-wise, fused RowWiseAdagrad, a linear head): model A as is, so torchrec's
delta tracker records its lookups; model B with one extra ``nn.Linear`` named like table
``t0``, so torchrec's tracker would misfile ``t0``'s lookups and deltarec records the module's
lookups itself (``deltarec.tracking.lookups.LookupRecorder``). Both are dumped every
``--every`` steps through ``make_train_hook``. The two models alternate step by step on the
same batches, so both see the same machine load; a step's time includes its dump's
training-thread share. Reported: mean and median step time of both and their ratio (B / A).

    python bench/bench_lookup_recorder.py [--steps 300] [--every 50] [--batch 256]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

TABLES = [f"t{i}" for i in range(4)]
ROWS = 10_000
DIM = 16
IDS_PER_SAMPLE = 4


def _model(clash: bool):
    import torch
    from torch import nn
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import (
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            configs = [
                EmbeddingBagConfig(
                    name=t, embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f_{t}"]
                )
                for t in TABLES
            ]
            self.ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
            self.head = nn.Linear(DIM * len(TABLES), 1)
            if clash:
                self.t0 = nn.Linear(1, 1)  # named like table t0: torchrec's tracker misfiles it

        def forward(self, kjt):
            return self.head(self.ebc(kjt).values()).sum()

    torch.manual_seed(0)
    model = Model()
    apply_optimizer_in_backward(RowWiseAdagrad, list(model.ebc.parameters()), {"lr": 0.05})
    gen = {t: (table_wise(rank=i // 2) if i % 2 else row_wise()) for i, t in enumerate(TABLES)}
    plan = ShardingPlan(
        {
            "ebc": construct_module_sharding_plan(
                model.ebc, gen, local_size=2, world_size=2, device_type="cpu"
            )
        }
    )
    dmp = DistributedModelParallel(
        model, device=torch.device("cpu"), plan=plan, sharders=[EmbeddingBagCollectionSharder()]
    )
    dense = torch.optim.SGD(model.head.parameters(), lr=0.01)
    return dmp, dense


def _per_rank(rank: int, world_size: int, steps: int, every: int, batch: int, tmp: str) -> dict:
    import numpy as np
    import torch
    from torchrec import KeyedJaggedTensor

    from deltarec.dump import make_train_hook

    models = {"torchrec": _model(False), "deltarec": _model(True)}
    hooks = {}
    via = {}
    for name, (dmp, _) in models.items():
        hook = make_train_hook(artifacts=tmp, run=name, every_steps=every, fsync=False)
        hook.on_start(dmp, 0, None)
        hooks[name] = hook
        via[name] = sorted(
            {"torchrec" if s.fqn in s.hub.tracker_fqns else "deltarec" for s in hook.dumper.sources}
        )
    rng = np.random.default_rng(rank)
    n = batch * len(TABLES)
    batches = [
        KeyedJaggedTensor.from_lengths_sync(
            [f"f_{t}" for t in TABLES],
            torch.from_numpy(rng.integers(0, ROWS, n * IDS_PER_SAMPLE)),
            torch.full((n,), IDS_PER_SAMPLE, dtype=torch.int32),
        )
        for _ in range(16)
    ]
    times: dict[str, list[float]] = {name: [] for name in models}
    try:
        for step in range(1, steps + 1):
            order = list(models.items())
            for name, (dmp, dense) in order if step % 2 else order[::-1]:
                t0 = time.perf_counter()
                dense.zero_grad()
                dmp(batches[step % len(batches)]).backward()
                dense.step()
                hooks[name].after_step(step)
                times[name].append(time.perf_counter() - t0)
        for hook in hooks.values():
            hook.on_end(steps)
    finally:
        for hook in hooks.values():
            hook.close()
    return {"times": times, "via": via}


def main() -> None:
    from deltarec.testing.multiprocess import run_on_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--batch", type=int, default=256)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = run_on_ranks(_per_rank, 2, args=(a.steps, a.every, a.batch, tmp), timeout_s=1200)
    print(
        f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
        f"load {os.getloadavg()[0]:.1f}, {a.steps} steps, dump every {a.every}, batch {a.batch}"
    )
    print("recorded by:", results[0]["via"])
    for rank, r in enumerate(results):
        t = {k: v[1:] for k, v in r["times"].items()}  # the first step warms up
        mean = {k: statistics.mean(v) * 1e3 for k, v in t.items()}
        med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
        print(
            f"rank {rank}: torchrec tracker {mean['torchrec']:.2f} ms/step (median "
            f"{med['torchrec']:.2f}); deltarec recorder {mean['deltarec']:.2f} ms/step (median "
            f"{med['deltarec']:.2f}); ratio {mean['deltarec'] / mean['torchrec']:.3f} (medians "
            f"{med['deltarec'] / med['torchrec']:.3f})"
        )


if __name__ == "__main__":
    main()
