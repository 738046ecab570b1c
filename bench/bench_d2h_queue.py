"""How long the training's small device-to-host reads wait behind a dump's copies to host.

A training step reads a scalar back (``loss.item()``) now and then. While the dump worker
copies gathered rows to pinned host memory on its own copy stream, that read may wait for the
dump's copies queued before it. This benchmark measures it with the dump's own copy engine
(``deltarec.tracking.pinned``): a thread copies ``--mb`` MiB of rows to host memory again and
again in chunks of ``--chunk-mb`` (each chunk queued whole, as the worker does), while the main
thread times ``x.sum().item()`` on the default stream. The baseline is the same read with no
copies running, in the same run.

    python bench/bench_d2h_queue.py [--mb 512] [--chunk-mb 32,8,2]

Prints, per mode, the read's median / p99 / max in microseconds and the copy bandwidth,
with date and machine. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np
import torch

import deltarec.tracking.pinned as pinned


def reads(x: torch.Tensor, n: int, gap_s: float) -> list[float]:
    """Microseconds each of ``n`` scalar reads of ``x.sum()`` took, ``gap_s`` apart."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        x.sum().item()
        out.append((time.perf_counter() - t0) * 1e6)
        time.sleep(gap_s)
    return out


def copier(rows: torch.Tensor, chunk_rows: int, stop: threading.Event, moved: list[int]) -> None:
    """Copy ``rows`` to pinned host memory chunk by chunk until ``stop``, as the worker does."""
    eng = pinned.copy_engine(rows.device)
    host_bytes = 0
    while not stop.is_set():
        for start in range(0, int(rows.shape[0]), chunk_rows):
            piece = rows[start : start + chunk_rows]
            _, event, _ = eng.to_host(piece, wait_current=False)
            assert event is not None
            event.synchronize()
            host_bytes += piece.nbytes
            if stop.is_set():
                break
    moved.append(host_bytes)


def measure(a: argparse.Namespace, rows: torch.Tensor, x: torch.Tensor, chunk_mb: float) -> dict:
    chunk_rows = max(1, int(chunk_mb * 2**20) // (rows.shape[1] * rows.element_size()))
    stop = threading.Event()
    moved: list[int] = []
    t = threading.Thread(target=copier, args=(rows, chunk_rows, stop, moved), daemon=True)
    began = time.perf_counter()
    t.start()
    time.sleep(0.2)  # the copier's pinned pool is warm
    got = reads(x, a.reads, a.gap_ms / 1e3)
    stop.set()
    t.join()
    wall = time.perf_counter() - began
    return {"reads_us": got, "gb_s": moved[0] / wall / 1e9}


def stats(us: list[float]) -> str:
    v = np.asarray(us)
    return f"{np.median(v):8.1f} {np.percentile(v, 99):8.1f} {v.max():8.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=512, help="rows copied per pass (MiB)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--chunk-mb", default="32", help="chunk sizes of the copier (MiB), a list")
    p.add_argument("--reads", type=int, default=2000)
    p.add_argument("--gap-ms", type=float, default=1.0, help="sleep between two reads")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_d2h_queue.py needs a CUDA device (none is visible)")
    dev = torch.device("cuda", torch.cuda.current_device())
    rows = torch.randn(int(a.mb * 2**20) // (a.dim * 4), a.dim, device=dev)
    x = torch.randn(1 << 16, device=dev)
    torch.cuda.synchronize(dev)
    idle = reads(x, a.reads, a.gap_ms / 1e3)
    sizes = [float(c) for c in a.chunk_mb.split(",")]
    runs = {c: measure(a, rows, x, c) for c in sizes}
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{when}  {platform.node()}  {torch.cuda.get_device_name(dev)}")
    print(f"rows {a.mb:g} MiB dim {a.dim}, {a.reads} reads")
    print(f"{'mode':<34} {'median':>8} {'p99':>8} {'max':>8}  (us)  copy GB/s")
    print(f"{'no copies (baseline)':<34} {stats(idle)}")
    base = float(np.percentile(idle, 99))
    for c, r in runs.items():
        label = f"chunks of {c:g} MiB queued whole"
        print(f"{label:<34} {stats(r['reads_us'])}  {r['gb_s']:.1f}")
    for c, r in runs.items():
        print(f"p99 / baseline p99, {c:g} MiB: {np.percentile(r['reads_us'], 99) / base:.1f}")


if __name__ == "__main__":
    main()
