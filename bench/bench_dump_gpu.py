"""A dump of a CUDA table: training-thread hold vs the bare device gather, commit vs the disk.

The table is a plain CUDA tensor (default 50M x 128 fp32) behind ``RowShardSource``; a dump
holds 10M touched rows (recorded with 50 % duplicate lookups). Measured in the same run:

* **bare device gather** (baseline of the hold): ``dedup_ids`` + ``index_select`` of the same
  lookups into device memory, then ``torch.cuda.synchronize`` (median of ``--reps`` + 2);
* **disk** (baseline of the throughput): the shard's bytes written with plain 8 MiB writes
  and one ``fsync`` into the same directory (median of 2);
* **dump**: ``dump_now`` then ``torch.cuda.synchronize`` (the training thread's hold), and
  until the dump is committed (fsync'd shard, manifest); peak extra RSS sampled every 2 ms
  (against the configured host budget, which bounds it), the host budget accounting's peak
  (``queue.peak_bytes``), where the memory is at the RSS peak, and the device staging peak;
* the same dump **without device staging, one encoding thread, a 64 MiB host budget** (the
  path before device staging), once, for comparison.

The committed shard is checked: sha256 and size against the manifest, row count, and the
first and last row groups against the table.

    python bench/bench_dump_gpu.py [--rows 50000000] [--dim 128] [--touched 10000000]
        [--dir /tmp] [--reps 3] [--queue-bytes N] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import pyarrow.parquet as pq
import torch

from bench_dump_throughput import PeakRss, baseline_write, rss_bytes
from deltarec.artifacts import ArtifactRoot, TableKind, TableSpec, check_shard
from deltarec.dump import Dumper, DumperConfig
from deltarec.tracking.gather import dedup_ids
from deltarec.tracking.plain import RowShardSource
from deltarec.tracking.tracker import ManualTracker, TrackerHub


class MemoryParts(PeakRss):
    """:class:`PeakRss` that also records, at the RSS peak, where the host memory is.

    ``parts`` holds at the peak: pinned host memory reserved by torch's caching host allocator
    (``pinned``, when torch reports it), pyarrow's memory pool (``arrow``), the encoders' piece
    buffer arena (``arena``) and the host budget's accounting (``budget``).
    """

    def __init__(self, dumper: Any) -> None:
        super().__init__()
        self.dumper = dumper
        self.parts: dict[str, int] = {}

    def sample(self) -> dict[str, int]:
        import pyarrow as pa

        d = self.dumper
        out = {"arrow": pa.total_allocated_bytes(), "budget": d.queue.outstanding_bytes}
        worker = d._worker
        if worker is not None:
            out["arena"] = worker.pool.arena._held
        stats = getattr(torch.cuda, "host_memory_stats", None)
        if stats is not None:
            with contextlib.suppress(RuntimeError):  # no CUDA context yet
                out["pinned"] = int(stats().get("reserved_bytes.current", 0))
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = rss_bytes()
            if rss > self.peak:
                self.peak, self.parts = rss, self.sample()
            time.sleep(0.002)


def bare_gather(weight: torch.Tensor, raw: torch.Tensor, reps: int) -> list[float]:
    """Seconds of dedup + index_select of ``raw`` on the device (synchronized)."""
    times = []
    for _ in range(reps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ids = dedup_ids(raw, weight.shape[0])
        rows = weight.index_select(0, ids)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        del ids, rows
    return times[2:]


def check_committed(workdir: str, weight: torch.Tensor, m: Any, touched: int) -> None:
    """sha256/size vs manifest, row count, first and last row group vs the table."""
    root = ArtifactRoot(workdir)
    dump_dir = root.dump_dir("bench", m.generation, m.seq)
    (shard,) = m.shards
    check_shard(root, dump_dir, shard)
    pf = pq.ParquetFile(os.path.join(dump_dir, shard.path))
    assert pf.metadata.num_rows == touched == shard.rows, (pf.metadata.num_rows, touched)
    for i in (0, pf.metadata.num_row_groups - 1):
        t = pf.read_row_group(i)
        keys = t.column("key").to_numpy()
        emb = np.stack(t.column("embedding").to_numpy(zero_copy_only=False))
        want = weight[torch.from_numpy(keys).to(weight.device)].cpu().numpy()
        assert np.array_equal(emb, want), f"row group {i} differs from the table"


def run_dumps(
    workdir: str, weight: torch.Tensor, raw: torch.Tensor, touched: int, reps: int, **cfg: Any
) -> dict[str, Any]:
    """``reps`` dumps of ``raw``'s rows; per dump: hold, commit time, peaks."""
    tracker = ManualTracker()
    hub = TrackerHub(tracker, {"t"})
    spec = TableSpec(dim=weight.shape[1], kind=TableKind.PLAIN, num_embeddings=weight.shape[0])
    source = RowShardSource("bench.table", spec, hub, "t", weight, 0)
    config = DumperConfig(artifacts=workdir, run="bench", snapshot=False, fsync=True, **cfg)
    dumper = Dumper(config, [source])
    dumper.start(step=0)
    tracker.record("t", torch.randperm(weight.shape[0], device=weight.device)[:65536])
    dumper.dump_now(1)  # warm-up: pinned buffers, threads, files
    dumper.wait_idle()
    out: dict[str, Any] = {"held": [], "commit": [], "rss": [], "bytes": 0, "parts": []}
    for rep in range(reps):
        tracker.record("t", raw)
        torch.cuda.synchronize()
        before = rss_bytes()
        dumper.queue.peak_bytes = 0
        base = MemoryParts(dumper).sample()
        with MemoryParts(dumper) as peak:
            t0 = time.perf_counter()
            dumper.dump_now(2 + rep)
            torch.cuda.synchronize()
            held = time.perf_counter() - t0
            dumper.wait_idle()
            commit = time.perf_counter() - t0
        m = dumper._worker.committed[-1] if dumper._worker else None
        assert m is not None and m.tables["bench.table"] == touched
        if rep == 0:
            check_committed(workdir, weight, m, touched)
        out["held"].append(held)
        out["commit"].append(commit)
        out["rss"].append(peak.peak - before)
        out["parts"].append(
            {k: v - base.get(k, 0) for k, v in peak.parts.items()} | {"at_start": base}
        )
        out["bytes"] = sum(s.bytes for s in m.shards)
        out["host_peak"] = dumper.queue.peak_bytes
        shutil.rmtree(ArtifactRoot(workdir).dump_dir("bench", m.generation, m.seq))
    out["budget"] = dumper.host_budget  # the queue holds it less the piece arena's share
    out["queue_capacity"] = dumper.queue.capacity
    out["device"] = dumper.device_budget.metrics()
    out["device_capacity"] = dumper.device_budget.capacity(weight.device)
    out["workers"] = config.encode_threads()
    dumper.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=50_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--touched", type=int, default=10_000_000)
    p.add_argument("--dups", type=float, default=0.5)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=None, help="directory on the disk to measure")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--no-before", action="store_true", help="skip the path without staging")
    p.add_argument("--queue-bytes", type=int, default=None, help="host budget (default: sized)")
    a = p.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    weight = torch.empty(a.rows, a.dim, dtype=torch.float32, device=dev).uniform_(-1, 1)
    unique = torch.randperm(a.rows, device=dev)[: a.touched]
    extra = unique[torch.randint(0, a.touched, (int(a.touched * a.dups),), device=dev)]
    raw = torch.cat([unique, extra])[torch.randperm(a.touched + extra.numel(), device=dev)]
    del unique, extra
    work = tempfile.mkdtemp(prefix="deltarec-gpu-dump-", dir=a.dir)
    res: dict[str, Any] = {}
    try:
        gather = bare_gather(weight, raw, a.reps)
        ours = run_dumps(
            os.path.join(work, "new"), weight, raw, a.touched, a.reps, queue_bytes=a.queue_bytes
        )
        disk = [baseline_write(os.path.join(work, "base.bin"), ours["bytes"]) for _ in range(2)]
        before = None
        if not a.no_before:
            before = run_dumps(
                os.path.join(work, "before"),
                weight,
                raw,
                a.touched,
                1,
                device_staging_share=0.0,
                encode_workers=1,
                queue_bytes=64 << 20,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    g, d = statistics.median(gather), statistics.median(disk)
    held, commit = statistics.median(ours["held"]), statistics.median(ours["commit"])
    disk_bw, ours_bw = ours["bytes"] / d, ours["bytes"] / commit
    res = {
        "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        "machine": f"{platform.node()} ({os.cpu_count()} cores), {torch.cuda.get_device_name()}",
        "workload": f"{a.rows} x {a.dim} fp32, {raw.numel()} lookups, {a.touched} unique",
        "bare_gather_s": gather,
        "disk_s": disk,
        "ours": ours,
        "before": before,
        "hold_ratio": held / g,
        "disk_ratio": ours_bw / disk_bw,
    }
    print(f"date      {res['date']}")
    print(f"machine   {res['machine']}, torch {torch.__version__}")
    print(f"workload  table {a.rows:,} x {a.dim} fp32, {raw.numel():,} lookups -> {a.touched:,}")
    print(
        f"budgets   host {ours['budget'] / 2**30:.2f} GiB, device "
        f"{ours['device_capacity'] / 2**30:.2f} GiB, {ours['workers']} encoding threads"
    )
    print(f"bare device gather (dedup + index_select)   median {g * 1e3:8.1f} ms  {gather}")
    print(f"dump: training thread held                  median {held * 1e3:8.1f} ms")
    print(f"hold / bare gather                          {held / g:.2f}  (target <= 2)")
    print(f"disk: 8 MiB writes + fsync                  {disk_bw / 1e9:.2f} GB/s  {disk}")
    print(
        f"dump: to commit                             median {commit:.2f} s, "
        f"{ours_bw / 1e9:.2f} GB/s, {a.touched / commit / 1e6:.2f} M rows/s"
    )
    print(f"dump / disk bandwidth                       {ours_bw / disk_bw:.2f}  (target >= 0.6)")
    print(
        f"host memory: peak extra RSS {max(ours['rss']) / 2**30:.2f} GiB "
        f"(/ budget {max(ours['rss']) / ours['budget']:.2f}, target <= 1); budget accounting "
        f"peak {ours['host_peak'] / 2**30:.2f} of {ours['queue_capacity'] / 2**30:.2f} GiB "
        f"(the rest: piece arena); device staging {ours['device']}"
    )
    print(f"runs      held {ours['held']}  commit {ours['commit']}")
    for rss, parts in zip(ours["rss"], ours["parts"], strict=True):
        print(f"at the RSS peak (+{rss / 2**30:.2f} GiB), change since the dump began: {parts}")
    if before is not None:
        print(
            f"before    (no device staging, 1 thread, 64 MiB): held {before['held'][0]:.2f} s, "
            f"commit {before['commit'][0]:.2f} s, "
            f"{before['bytes'] / before['commit'][0] / 1e9:.2f} GB/s"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
