"""Dump throughput on one rank: touched rows into committed, fsync'd artifacts, and peak RSS.

For each delta size (default 1M and 4M touched rows of dim 64, float32) the dumper writes one
delta dump (gather, encode, parquet shard with sha256, fsync, rename, manifest) and waits for
its commit (after one small warm-up dump, as in a long-running job). Baseline, measured
in the same run on the same disk (median of 3): writing the same number of
bytes with plain ``write`` calls of 8 MiB and one ``fsync``. Peak extra RSS is the highest
resident set size sampled (every 2 ms) during the dump minus the RSS just before it; CPU s is
the process CPU time the dump took (every thread; on a shared machine less noisy than wall).

    python bench/bench_dump_throughput.py [--rows 1000000 4000000] [--dir /tmp/x]
        [--queue-bytes N]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

from deltarec.artifacts import TableKind, TableSpec
from deltarec.dump import Dumper, DumperConfig
from deltarec.dump.budget import default_host_budget
from deltarec.tracking.plain import RowShardSource
from deltarec.tracking.tracker import ManualTracker, TrackerHub


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Samples RSS in a thread; ``peak`` is the highest value seen."""

    def __init__(self) -> None:
        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.002)

    def __enter__(self) -> PeakRss:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss_bytes())


def baseline_write(path: str, nbytes: int) -> float:
    """Seconds to write ``nbytes`` with plain 8 MiB writes and one fsync."""
    block = os.urandom(8 << 20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())
    secs = time.perf_counter() - t0
    os.remove(path)
    return secs


def one_dump(
    workdir: str, weight: torch.Tensor, touched: int, dim: int, queue_bytes: int | None = None
) -> dict:
    tracker = ManualTracker()
    hub = TrackerHub(tracker, {"t"})
    spec = TableSpec(dim=dim, kind=TableKind.PLAIN, num_embeddings=weight.shape[0])
    source = RowShardSource("bench.table", spec, hub, "t", weight, 0)
    config = DumperConfig(
        artifacts=workdir, run="bench", snapshot=False, fsync=True, queue_bytes=queue_bytes
    )
    dumper = Dumper(config, [source])
    dumper.start(step=0)
    tracker.record("t", torch.randperm(weight.shape[0])[:65536])  # warm-up dump, not measured
    dumper.dump_now(1)
    dumper.wait_idle()
    ids = torch.randperm(weight.shape[0])[:touched]
    tracker.record("t", ids)
    del ids
    before = rss_bytes()
    with PeakRss() as peak:
        t0, cpu0 = time.perf_counter(), time.process_time()
        dumper.dump_now(2)
        t_enqueued = time.perf_counter() - t0
        dumper.wait_idle()
        secs = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
    m = dumper._worker.committed[-1] if dumper._worker else None
    dumper.close()
    assert m is not None and m.tables["bench.table"] == touched
    return {
        "secs": secs,
        "cpu": cpu,
        "train_wait": t_enqueued,
        "bytes": sum(s.bytes for s in m.shards),
        "extra_rss": peak.peak - before,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 4_000_000])
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--dir", default=None, help="directory on the disk to measure")
    p.add_argument("--queue-bytes", type=int, default=None, help="host budget (default: sized)")
    a = p.parse_args()
    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="deltarec-dump-bench-", dir=a.dir)
    weight = torch.randn(max(a.rows), a.dim)
    print(f"date      {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}")
    print(f"machine   {platform.node()} ({os.cpu_count()} cores), {platform.platform()}")
    print(f"disk      {work}; load average {os.getloadavg()[0]:.1f}")
    budget = a.queue_bytes if a.queue_bytes is not None else default_host_budget()
    print(f"budget    host staging budget {budget / 2**20:.0f} MiB")
    print(
        f"{'touched rows':>12} {'dump s':>7} {'rows/s':>10} {'MB/s':>7} {'baseline MB/s':>13} "
        f"{'ratio':>6} {'train waits s':>13} {'extra RSS MB':>12} {'CPU s':>6}"
    )
    try:
        for n in a.rows:
            r = one_dump(os.path.join(work, f"d{n}"), weight, n, a.dim, a.queue_bytes)
            base = statistics.median(
                baseline_write(os.path.join(work, "baseline.bin"), r["bytes"]) for _ in range(3)
            )
            ours_bw, base_bw = r["bytes"] / r["secs"], r["bytes"] / base
            print(
                f"{n:>12,} {r['secs']:>7.2f} {n / r['secs']:>10,.0f} {ours_bw / 1e6:>7.0f} "
                f"{base_bw / 1e6:>13.0f} {ours_bw / base_bw:>6.2f} {r['train_wait']:>13.2f} "
                f"{r['extra_rss'] / 2**20:>12.0f} {r['cpu']:>6.2f}"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("targets   >= 1,000,000 rows/s, ratio >= 0.60, extra RSS <= 256 MB")
    print("CPU s     process CPU time of the dump, every thread (load-independent cost)")


if __name__ == "__main__":
    main()
