"""The hook's own host time per training step, on CPU tables (no device work to wait for).

What a training loop pays at every step besides the dumps: ``ManualTracker.record`` for each
table's lookup and ``DumpHook.after_step`` (which marks the recorded lookups every
``ABSORB_STEPS`` steps), and a group's marking call alone (``TableGroup.absorb``, the part the
GPU loop's ``after_step`` spends most in). Tiny lookups (4 ids) so that the figures are the
calls' overhead, not their arithmetic. Run it against two checkouts in alternation to compare
code (``PYTHONPATH=<checkout>/src``); the figures are microseconds.

Usage:
    python bench/bench_hook_step.py [--steps 4000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any

import torch

from deltarec.api import (
    ManualTracker,
    RowShardSource,
    TableKind,
    TableSpec,
    TrackerHub,
    TrainSettings,
    hook_from_env,
)
from deltarec.tracking.groups import TableGroup

ROWS = [500_000, 200_000, 100_000]


def _sources(hub: TrackerHub, tables: dict[str, torch.Tensor]) -> list[RowShardSource]:
    return [
        RowShardSource(
            f"model.{n}",
            TableSpec(dim=16, kind=TableKind.PLAIN, num_embeddings=int(w.shape[0])),
            hub,
            n,
            w,
            row_offset=0,
        )
        for n, w in tables.items()
    ]


def hook_step(steps: int) -> dict[str, float]:
    """Microseconds a step in the record calls and in ``after_step`` (no dump due)."""
    tables = {f"t{i}": torch.zeros(r, 16) for i, r in enumerate(ROWS)}
    tracker = ManualTracker()
    hub = TrackerHub(tracker, set(tables))
    env = TrainSettings(
        artifacts=tempfile.mkdtemp(prefix="deltarec-hook-step-"),
        run="bench",
        dump_every_steps=10 * steps,
    ).to_env()
    hook = hook_from_env(sources=lambda _m: _sources(hub, tables), environ=env)
    hook.on_start(torch.nn.Module(), step=0, restored_from=None)
    ids = {n: torch.randint(0, int(w.shape[0]), (4,)) for n, w in tables.items()}
    rec = after = 0
    try:
        for step in range(1, steps + 1):
            t0 = time.perf_counter_ns()
            for n, x in ids.items():
                tracker.record(n, x)
            t1 = time.perf_counter_ns()
            hook.after_step(step)
            t2 = time.perf_counter_ns()
            if step > steps // 8:  # warmed up
                rec, after = rec + t1 - t0, after + t2 - t1
    finally:
        hook.close()
    n = steps - steps // 8
    return {"record_us": rec / n / 1e3, "after_step_us": after / n / 1e3}


def absorb_call(calls: int) -> float:
    """Microseconds of one ``TableGroup.absorb`` of 16 steps' lookups of three tables."""
    tables = {f"t{i}": torch.zeros(r, 16) for i, r in enumerate(ROWS)}
    tracker = ManualTracker()
    hub = TrackerHub(tracker, set(tables))
    sources = _sources(hub, tables)
    for s in sources:
        s.graph_bytes, s.spread_steps = 0, None
    group = TableGroup.of(sources)
    ids = {n: torch.randint(0, int(w.shape[0]), (4,)) for n, w in tables.items()}
    total = 0
    for _ in range(calls):
        for _ in range(16):
            for n, x in ids.items():
                tracker.record(n, x)
        t0 = time.perf_counter_ns()
        group.absorb()
        total += time.perf_counter_ns() - t0
    return total / calls / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    got: dict[str, Any] = hook_step(a.steps)
    got["absorb_us"] = absorb_call(a.steps // 4)
    print(" ".join(f"{k} {v:.2f}" for k, v in got.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(got, f)


if __name__ == "__main__":
    main()
