"""Wall time of ``deltarec train`` on 2 CPU ranks vs 1 CPU rank, 300 steps of the example model.

Run: ``.venv/bin/python bench/bench_train.py [--steps N] [--batch-size B]``

Both runs are real ``deltarec train`` processes (torchrun, gloo, default example model: seven
tables over every sharding type, batch ``B`` per rank, no checkpoints, no dumps):

* measured: ``--nproc-per-node 2`` - the target is a whole run (launch to exit) under 60 s;
* baseline: ``--nproc-per-node 1`` - the same per-rank work on one rank, no cross-rank
  communication.

Reported per run: the whole process wall time (torchrun start, imports, sharding, training,
exit), the CPU seconds of every process of the run (less sensitive than wall time to other
jobs on a shared box), and the training-loop rate printed by the trainer; ratios are
2-rank / 1-rank.
The load average is printed too: on a shared box it explains noisy numbers.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import resource
import subprocess
import sys
import time


def _run(nproc: int, steps: int, batch_size: int) -> tuple[float, float, float]:
    cmd = [
        sys.executable, "-c", "import sys; from deltarec.cli import main; sys.exit(main())",
        "train", "--nproc-per-node", str(nproc), "--steps", str(steps),
        "--batch-size", str(batch_size), "--log-every", str(steps),
    ]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        raise SystemExit(f"deltarec train failed ({done.returncode}):\n{done.stderr[-3000:]}")
    m = re.search(r"\(([\d.]+) steps/s\)", done.stdout)
    return wall, float(m.group(1)) if m else float("nan"), cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args()
    two_wall, two_rate, two_cpu = _run(2, args.steps, args.batch_size)
    one_wall, one_rate, one_cpu = _run(1, args.steps, args.batch_size)
    load = os.getloadavg()[0]
    print(f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}")
    print(f"machine: {platform.node()}, {os.cpu_count()} cores, load average {load:.1f}")
    print(f"work: {args.steps} steps, batch {args.batch_size} per rank, default example model")
    print()
    print("| run | whole run wall (s) | CPU s, all processes | training steps/s |")
    print("|---|---|---|---|")
    print(f"| 2 ranks (measured) | {two_wall:.1f} | {two_cpu:.1f} | {two_rate:.1f} |")
    print(f"| 1 rank (baseline) | {one_wall:.1f} | {one_cpu:.1f} | {one_rate:.1f} |")
    ratios = f"{two_wall / one_wall:.2f} | {two_cpu / one_cpu:.2f} | {two_rate / one_rate:.2f}"
    print(f"| ratio 2 / 1 | {ratios} |")
    print()
    print(f"target: 2-rank whole run under 60 s -> {'met' if two_wall < 60 else 'NOT met'}")


if __name__ == "__main__":
    main()
