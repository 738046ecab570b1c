"""Training-step time with a dump every 50 steps vs no tracking, 2 CPU ranks, example model.

Each rank builds the example model twice (same seed, same plan): model A trains with no
tracking at all, model B with the dumper attached (torchrec delta tracker, a dump every
``--every`` steps into a local artifact root, snapshot at start). The two models alternate
step by step on the same batches, so both see the same machine load; the per-step time of B
includes its dumps (the training thread's share: gather and enqueue; the writing happens in
the background worker). Reported: mean and median step time of both and the ratio of means.

    python bench/bench_dump_step.py [--steps 300] [--every 50] [--batch 256]
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


def _per_rank(rank: int, world_size: int, steps: int, every: int, batch: int, tmp: str) -> dict:
    import torch

    from deltarec.dump import make_train_hook
    from deltarec.model.config import ModelConfig
    from deltarec.model.data import ClickStream, DataConfig
    from deltarec.model.sharding import build_sharded_model

    cfg = ModelConfig()
    device = torch.device("cpu")
    plain = build_sharded_model(cfg, device, seed=0, max_batch_size=batch)
    dumped = build_sharded_model(cfg, device, seed=0, max_batch_size=batch)
    hook = make_train_hook(artifacts=f"{tmp}/art", run="bench", every_steps=every or None)
    hook.on_start(dumped.dmp, 0, None)
    stream = ClickStream(cfg, DataConfig(), batch, 0, rank)
    times: dict[str, list[float]] = {"none": [], "dump": []}
    try:
        for step in range(1, steps + 1):
            b = stream.batch(step - 1)
            order = (("none", plain), ("dump", dumped))
            for name, sm in order if step % 2 else order[::-1]:
                t0 = time.perf_counter()
                sm.optimizer.zero_grad()
                loss, _ = sm.dmp(*b.model_inputs())
                loss.backward()
                sm.optimizer.step()
                if name == "dump":
                    hook.after_step(step)
                times[name].append(time.perf_counter() - t0)
        hook.on_end(steps)
    finally:
        hook.close()
    assert hook.dumper is not None
    d = hook.dumper
    deltas = list(d.dump_timings)[1:-1]  # periodic deltas: not the snapshot, not the final dump
    per_table = {t: statistics.fmean(x[t] for x in deltas) for t in deltas[0]} if deltas else {}
    return {
        "times": times,
        "dump_seconds": list(d.dump_seconds),
        "dump_cpu": list(getattr(d, "dump_cpu_seconds", [])),
        "per_table": per_table,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=50, help="0: track only, no periodic dumps")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--warmup", type=int, default=20, help="steps left out of the statistics")
    a = p.parse_args()
    from deltarec.testing.multiprocess import run_on_ranks

    with tempfile.TemporaryDirectory(prefix="deltarec-step-bench-") as tmp:
        results = run_on_ranks(_per_rank, 2, args=(a.steps, a.every, a.batch, tmp), timeout_s=1800)
    # a step ends when the slower rank ends it: take the max over ranks per step
    stats = {}
    for name in ("none", "dump"):
        per_step = [max(r["times"][name][i] for r in results) for i in range(a.steps)]
        kept = per_step[a.warmup :]
        stats[name] = (statistics.fmean(kept), statistics.median(kept))
    dumps = results[0]["dump_seconds"][1:-1]
    print(f"date      {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}")
    print(f"machine   {platform.node()} ({os.cpu_count()} cores), load {os.getloadavg()[0]:.1f}")
    print(
        f"workload  example model, 2 CPU ranks (gloo), batch {a.batch}/rank, {a.steps} steps "
        f"(first {a.warmup} left out), dump every {a.every} steps"
    )
    print(f"{'run':<34} {'mean ms':>8} {'median ms':>10}")
    for label, key in (("no tracking (baseline)", "none"), ("tracker + dump every N", "dump")):
        print(f"{label:<34} {stats[key][0] * 1e3:>8.2f} {stats[key][1] * 1e3:>10.2f}")
    ratio_mean = stats["dump"][0] / stats["none"][0]
    ratio_median = stats["dump"][1] / stats["none"][1]
    print(f"ratio     {ratio_mean:.3f} (means), {ratio_median:.3f} (medians); target <= 1.03")
    shown = ", ".join(f"{s * 1e3:.1f}" for s in dumps)
    print(f"deltas    {len(dumps)} periodic dumps, training-thread wall ms (rank 0): {shown}")
    for r, res in enumerate(results):
        cpu = res["dump_cpu"][1:-1]
        if cpu:
            print(
                f"rank {r}    training-thread CPU ms per periodic dump: mean "
                f"{statistics.fmean(cpu) * 1e3:.1f}, max {max(cpu) * 1e3:.1f}"
            )
        per = ", ".join(f"{t} {s * 1e3:.1f}" for t, s in res["per_table"].items())
        print(f"rank {r}    mean wall ms per table and periodic dump: {per}")


if __name__ == "__main__":
    main()
