"""Does the trainer's background compaction slow training? (SPEC §3a, issue 43 item 2)

One CPU rank trains the example model (its ``user_id`` table grown to ``--rows`` rows) with the
dump hook, a dump every ``--every`` steps into a local artifact root, snapshot at start. Runs
alternate, each a fresh process: ``off`` (``compact_every_dumps`` unset) and ``on``
(``compact_every_dumps = --compact-every``: rank 0 compacts its generation in a child
process), in ABBA order for ``--pairs`` pairs, so both see the same drift of the machine's load.
Per run: step-time mean, p99 and max (first ``--warmup`` steps left out); for ``on`` also the
steps that overlapped a compaction against the steps of the same run that did not, each
compaction's own wall time and how much of the run a compaction was running. Ratios are
``on / off`` over the runs of each kind.

    python bench/bench_compact_beside_training.py [--pairs 2] [--steps 1500] [--every 20]
        [--compact-every 5] [--rows 1000000] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def _run(rank: int, world_size: int, a: dict, compact_every: int | None, tmp: str) -> dict:
    import torch

    from deltarec.dump import make_train_hook
    from deltarec.model.config import ModelConfig, TableConfig
    from deltarec.model.data import ClickStream, DataConfig
    from deltarec.model.sharding import build_sharded_model

    tables = ModelConfig().tables
    tables["user_id"] = TableConfig(num_embeddings=a["rows"], dim=32, sharding="table_wise")
    cfg = ModelConfig(tables=tables)
    sm = build_sharded_model(cfg, torch.device("cpu"), seed=0, max_batch_size=a["batch"])
    options = {} if compact_every is None else {"compact_every_dumps": compact_every}
    hook = make_train_hook(artifacts=f"{tmp}/art", run="bench", every_steps=a["every"], **options)
    hook.on_start(sm.dmp, 0, None)
    stream = ClickStream(cfg, DataConfig(), a["batch"], 0, rank)
    starts, times = [], []
    try:
        for step in range(1, a["steps"] + 1):
            b = stream.batch(step - 1)
            t0 = time.perf_counter()
            sm.optimizer.zero_grad()
            loss, _ = sm.dmp(*b.model_inputs())
            loss.backward()
            sm.optimizer.step()
            hook.after_step(step)
            starts.append(t0)
            times.append(time.perf_counter() - t0)
        end = time.perf_counter()
        compactor = hook.dumper.compactor if hook.dumper is not None else None
        spans = list(compactor.spans) if compactor is not None else []
        if compactor is not None and compactor.running_since is not None:
            spans.append((compactor.running_since, end))  # cut short by the close below
        hook.on_end(a["steps"])
    finally:
        hook.close()
    first = starts[a["warmup"]]
    return {
        "starts": starts,
        "times": times,
        "spans": spans,
        "window": [first, end],
        "failures": compactor.failures if compactor is not None else 0,
    }


def _p(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _summary(r: dict, warmup: int) -> dict:
    times, starts = r["times"][warmup:], r["starts"][warmup:]
    lo, hi = r["window"]
    busy = sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in r["spans"])

    def overlaps(i: int) -> bool:
        return any(s < starts[i] + times[i] and starts[i] < e for s, e in r["spans"])

    during = [t for i, t in enumerate(times) if overlaps(i)]
    outside = [t for i, t in enumerate(times) if not overlaps(i)]
    return {
        "mean_ms": statistics.fmean(times) * 1e3,
        "median_ms": statistics.median(times) * 1e3,
        "p99_ms": _p(times, 0.99) * 1e3,
        "max_ms": max(times) * 1e3,
        "compactions": len(r["spans"]),
        "compaction_s": [round(e - s, 2) for s, e in r["spans"]],
        "compacting_share": busy / (hi - lo),
        "steps_during": len(during),
        "mean_during_ms": statistics.fmean(during) * 1e3 if during else None,
        "mean_outside_ms": statistics.fmean(outside) * 1e3 if during and outside else None,
        "failures": r["failures"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--every", type=int, default=20, help="a dump every N steps")
    p.add_argument("--compact-every", type=int, default=5, help="compact every N dumps (on)")
    p.add_argument("--rows", type=int, default=1_000_000, help="rows of the user_id table")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--warmup", type=int, default=20, help="steps left out of the statistics")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    from deltarec.testing.multiprocess import run_on_ranks

    order = [k for _ in range(a.pairs) for k in ("off", "on", "on", "off")][: 2 * a.pairs]
    runs: list[dict] = []
    for kind in order:
        with tempfile.TemporaryDirectory(prefix="deltarec-compact-bench-") as tmp:
            every = a.compact_every if kind == "on" else None
            load = os.getloadavg()[0]
            (res,) = run_on_ranks(_run, 1, args=(vars(a), every, tmp), timeout_s=1800)
        s = {"kind": kind, "load": load, **_summary(res, a.warmup)}
        runs.append(s)
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items()}),
              flush=True)  # fmt: skip

    def agg(kind: str, key: str) -> float:
        return statistics.fmean(r[key] for r in runs if r["kind"] == kind)

    ratios = {k: agg("on", k) / agg("off", k) for k in ("mean_ms", "p99_ms", "max_ms")}
    during = [r["mean_during_ms"] for r in runs if r["kind"] == "on" and r["mean_during_ms"]]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).parent,
    ).stdout.strip()
    print(f"date      {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}")
    print(f"machine   {platform.node()} ({os.cpu_count()} cores), commit {commit}")
    print(
        f"workload  example model, user_id {a.rows:,} rows dim 32, 1 CPU rank, batch {a.batch}, "
        f"{a.steps} steps a run, a dump every {a.every} steps, on: compact every "
        f"{a.compact_every} dumps; runs {' '.join(order)}"
    )
    for k, v in ratios.items():
        print(f"on / off  {k[:-3]:<6} {agg('on', k):8.2f} / {agg('off', k):8.2f} ms = {v:.3f}")
    if during:
        print(
            f"steps overlapping a compaction: mean {statistics.fmean(during):.2f} ms "
            f"({statistics.fmean(during) / agg('off', 'mean_ms'):.3f} of off's mean)"
        )
    for r in runs:  # the same process with and without a compaction running: no run-to-run drift
        if r["mean_during_ms"] and r["mean_outside_ms"]:
            print(
                f"on run  steps during / outside a compaction: {r['mean_during_ms']:.2f} / "
                f"{r['mean_outside_ms']:.2f} ms = {r['mean_during_ms'] / r['mean_outside_ms']:.3f}"
            )
    secs = [s for r in runs for s in r["compaction_s"]]
    if secs:
        print(
            f"compaction  {len(secs)} runs, wall s: median {statistics.median(secs):.2f}, "
            f"max {max(secs):.2f}; compacting {agg('on', 'compacting_share'):.0%} of the on runs"
        )
    if a.json:
        report = {"args": vars(a), "commit": commit, "runs": runs, "ratios": ratios}
        Path(a.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
