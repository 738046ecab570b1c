"""Dedup + gather + device→host of touched rows into pinned host memory, vs pinned D2H bandwidth.

Measures the dump's device side (``deltarec.tracking.gather``: ``dedup_ids`` then
``gather_to_host``, which gathers chunk k+1 while chunk k is copied on a copy stream into
pinned buffers) against the baseline of the same run: one contiguous device tensor of the
same bytes copied into a pinned host tensor. Imports only torch, numpy and the gather core,
so it runs on a CUDA machine without torchrec.

    python bench/bench_gather_cuda.py                     # 50M-row table, 10M touched, dim 128
    python bench/bench_gather_cuda.py --rows 200000 --touched 50000 --dim 16   # a quick try

Prints a table with date, machine, both bandwidths and the ratio (target: >= 0.90).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

from deltarec.tracking.gather import dedup_ids, gather_to_host


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def baseline_copy(src: torch.Tensor, reps: int) -> list[float]:
    """Seconds per contiguous device→pinned-host copy of ``src``."""
    host = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
    times = []
    for _ in range(reps + 1):
        _sync(src.device)
        t0 = time.perf_counter()
        host.copy_(src, non_blocking=True)
        _sync(src.device)
        times.append(time.perf_counter() - t0)
    return times[1:]


def dump_path(
    weight: torch.Tensor, raw_ids: torch.Tensor, chunk_rows: int, reps: int
) -> tuple[list[float], int]:
    """Seconds per dedup + chunked gather + copy into pinned host chunks (all waited for)."""
    times = []
    n = 0
    for _ in range(reps + 1):  # the first run warms the pinned-memory cache
        _sync(weight.device)
        t0 = time.perf_counter()
        ids = dedup_ids(raw_ids)
        chunks = list(gather_to_host(weight, ids, chunk_rows))
        for c in chunks:
            c.wait()
        times.append(time.perf_counter() - t0)
        n = sum(len(c) for c in chunks)
        del chunks
    return times[1:], n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=50_000_000, help="table rows")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--touched", type=int, default=10_000_000, help="unique touched ids")
    p.add_argument("--dups", type=float, default=0.5, help="extra duplicate lookups (fraction)")
    p.add_argument("--chunk-rows", type=int, default=1 << 20)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    dev = torch.device(a.device)
    torch.manual_seed(0)
    weight = torch.empty(a.rows, a.dim, dtype=torch.float32, device=dev)
    weight.uniform_(-1, 1)
    unique = torch.randperm(a.rows, device=dev)[: a.touched]
    extra = unique[torch.randint(0, a.touched, (int(a.touched * a.dups),), device=dev)]
    raw = torch.cat([unique, extra])[torch.randperm(a.touched + extra.numel(), device=dev)]
    payload = torch.empty(a.touched, a.dim, dtype=torch.float32, device=dev).uniform_()
    nbytes = a.touched * a.dim * 4

    base = baseline_copy(payload, a.reps)
    del payload
    ours, n = dump_path(weight, raw, a.chunk_rows, a.reps)
    assert n == a.touched, (n, a.touched)
    # correctness spot check: the last run's rows equal weight[sorted unique ids]
    ids = dedup_ids(raw)
    first = next(gather_to_host(weight, ids, 4096))
    first.wait()
    assert torch.equal(first.rows, weight[ids[:4096]].cpu())

    b, o = statistics.median(base), statistics.median(ours)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor()
    print(f"date      {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}")
    print(f"machine   {platform.node()} ({os.cpu_count()} cores), device {dev} {name}")
    print(f"torch     {torch.__version__}")
    print(
        f"workload  table {a.rows:,} x {a.dim} fp32, {raw.numel():,} lookups -> "
        f"{a.touched:,} unique rows ({nbytes / 1e9:.2f} GB), chunks of {a.chunk_rows:,} rows"
    )
    print(f"{'path':<52} {'median s':>9} {'GB/s':>8}")
    for label, secs in (
        ("baseline: contiguous D2H copy into pinned memory", b),
        ("dedup + gather + D2H (deltarec.tracking.gather)", o),
    ):
        print(f"{label:<52} {secs:>9.4f} {nbytes / secs / 1e9:>8.2f}")
    print(f"ratio     {b / o:.3f} of the pinned D2H bandwidth (target >= 0.90)")
    print(f"runs      baseline {[round(x, 4) for x in base]}  ours {[round(x, 4) for x in ours]}")


if __name__ == "__main__":
    main()
