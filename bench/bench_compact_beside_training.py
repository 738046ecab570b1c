"""Does the trainer's background compaction slow training? (SPEC §3a, issue 43 item 2)

One CPU rank trains the example model (its ``user_id`` table grown to ``--rows`` rows) with the
dump hook, a dump every ``--every`` steps into a local artifact root, snapshot at start. Runs
alternate, each a fresh process: ``off`` (``compact_every_dumps`` unset) and ``on``
(``compact_every_dumps = --compact-every``: rank 0 compacts its generation in a child
process), in ABBA order for ``--pairs`` pairs, so both see the same drift of the machine's load.
Per run: step-time mean, p99 and max (first ``--warmup`` steps left out); for ``on`` also the
steps that overlapped a compaction against the steps of the same run that did not, each
compaction's own wall time and how much of the run a compaction was running. Ratios are
``on / off`` over the runs of each kind. With several ``--busy-share`` values there is an ``on``
kind for each (``on@S``: ``compact_busy_share = S``), run in the order off, each share, then
the same reversed, for each pair; each on run also gives its triggers, how many were folded
into a later one (the compaction had fallen behind) and the last compaction's pacing report.

    python bench/bench_compact_beside_training.py [--pairs 2] [--steps 1500] [--every 20]
        [--compact-every 5] [--rows 1000000] [--busy-share 1 0.5 0.25] [--json PATH]
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


def _run(
    rank: int, world_size: int, a: dict, compact_every: int | None, share: float, tmp: str
) -> dict:
    import torch

    from deltarec.dump import make_train_hook
    from deltarec.model.config import ModelConfig, TableConfig
    from deltarec.model.data import ClickStream, DataConfig
    from deltarec.model.sharding import build_sharded_model

    tables = ModelConfig().tables
    tables["user_id"] = TableConfig(num_embeddings=a["rows"], dim=32, sharding="table_wise")
    cfg = ModelConfig(tables=tables)
    sm = build_sharded_model(cfg, torch.device("cpu"), seed=0, max_batch_size=a["batch"])
    options: dict = {}
    if compact_every is not None:
        options = {"compact_every_dumps": compact_every, "compact_busy_share": share}
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
        "skipped": compactor.skipped if compactor is not None else 0,
        "triggers": compactor.triggered if compactor is not None else 0,
        "report": compactor.last_report if compactor is not None else None,
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
        "triggers": r["triggers"],
        "skipped": r["skipped"],
        "last_report": r["report"],
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
    p.add_argument(
        "--busy-share",
        type=float,
        nargs="+",
        default=[1.0],
        help="compact_busy_share of the on runs; several: an on kind for each (on@S)",
    )
    p.add_argument("--json", default=None)
    a = p.parse_args()
    from deltarec.testing.multiprocess import run_on_ranks

    ons = [f"on@{s:g}" for s in a.busy_share] if len(a.busy_share) > 1 else ["on"]
    share_of = dict(zip(ons, a.busy_share, strict=True))
    kinds = ["off", *ons]
    order = [k for i in range(a.pairs) for k in (kinds if i % 2 == 0 else kinds[::-1])]
    if len(kinds) == 2:  # off on on off: as before
        order = [k for _ in range(a.pairs) for k in ("off", "on", "on", "off")][: 2 * a.pairs]
    runs: list[dict] = []
    for kind in order:
        with tempfile.TemporaryDirectory(prefix="deltarec-compact-bench-") as tmp:
            every = a.compact_every if kind != "off" else None
            share = share_of.get(kind, 1.0)
            load = os.getloadavg()[0]
            (res,) = run_on_ranks(_run, 1, args=(vars(a), every, share, tmp), timeout_s=1800)
        s = {"kind": kind, "load": load, **_summary(res, a.warmup)}
        runs.append(s)
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items()}),
              flush=True)  # fmt: skip

    def agg(kind: str, key: str) -> float:
        return statistics.fmean(r[key] for r in runs if r["kind"] == kind)

    ratios = {
        on: {k: agg(on, k) / agg("off", k) for k in ("mean_ms", "p99_ms", "max_ms")} for on in ons
    }
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
    for on in ons:
        _report_kind(runs, on, share_of[on], ratios[on], agg)
    if a.json:
        report = {"args": vars(a), "commit": commit, "runs": runs, "ratios": ratios}
        Path(a.json).write_text(json.dumps(report, indent=2))


def _report_kind(runs: list[dict], on: str, share: float, ratios: dict, agg) -> None:  # type: ignore[no-untyped-def]
    """The lines of one on kind against the off runs."""
    print(f"-- {on} (compact_busy_share {share:g})")
    for k, v in ratios.items():
        print(f"{on} / off  {k[:-3]:<6} {agg(on, k):8.2f} / {agg('off', k):8.2f} ms = {v:.3f}")
    mine = [r for r in runs if r["kind"] == on]
    during = [r["mean_during_ms"] for r in mine if r["mean_during_ms"]]
    if during:
        print(
            f"steps overlapping a compaction: mean {statistics.fmean(during):.2f} ms "
            f"({statistics.fmean(during) / agg('off', 'mean_ms'):.3f} of off's mean)"
        )
    for r in mine:  # the same process with and without a compaction running: no run-to-run drift
        if r["mean_during_ms"] and r["mean_outside_ms"]:
            print(
                f"{on} run  steps during / outside a compaction: {r['mean_during_ms']:.2f} / "
                f"{r['mean_outside_ms']:.2f} ms = {r['mean_during_ms'] / r['mean_outside_ms']:.3f}"
            )
    secs = [s for r in mine for s in r["compaction_s"]]
    if secs:
        print(
            f"compaction  {len(secs)} runs, wall s: median {statistics.median(secs):.2f}, "
            f"max {max(secs):.2f}; compacting {agg(on, 'compacting_share'):.0%} of the runs; "
            f"triggers {sum(r['triggers'] for r in mine)}, folded into a later one "
            f"{sum(r['skipped'] for r in mine)} (fallen behind)"
        )
    paced = [r["last_report"] for r in mine if r["last_report"]]
    if paced:
        busy = sum(p.get("busy_s", 0.0) for p in paced)
        slept = sum(p.get("paced_s", 0.0) for p in paced)
        print(
            f"last compaction of each run: busy {busy:.2f} s, paced {slept:.2f} s "
            f"(busy share {busy / max(busy + slept, 1e-9):.2f})"
        )


if __name__ == "__main__":
    main()
