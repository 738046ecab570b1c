"""Benchmark: a serving replica's applies, lookups and freshness (deltarec.serving).

Builds one generation of one table (``rows`` keys of ``dim`` float32 values: a snapshot, then
``deltas`` delta dumps of ``delta_rows`` random keys each, 5% of them deletes), then measures:

1. **apply**: rows/s of :meth:`Replica.apply` per delta (reading and checking the shards,
   staging the copy-on-write state, publishing), against the baseline of reading the same
   shards alone (:func:`deltarec.artifacts.iter_shard` with its sha256 check), same run.
2. **lookup**: latency p50/p99 of one lookup of a batch of ``B`` random held ids (encoded
   rows into a tensor on the device), idle and while another thread applies dumps without
   pause, against the baseline of a bare ``torch.index_select`` of the same rows from one
   dense tensor (no key index). Per-id cost beside it (the anchor: FBGEMM's ~2 us per read
   with its streaming update's locking).
3. **freshness**: seconds from a dump being taken (``taken_at``, the training step) to its
   rows being visible in a replica polled by a :class:`Follower` every ``poll`` seconds.

usage: .venv/bin/python bench/bench_serving.py [--rows N] [--dim D] [--deltas K]
           [--delta-rows M] [--device cpu|cuda] [--poll S]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import tempfile
import threading
import time

import numpy as np
import torch

from deltarec.artifacts import (
    ArtifactRoot,
    DType,
    DumpKind,
    ShardRows,
    TableSpec,
    iter_shard,
    utc_now,
    write_dump,
)
from deltarec.serving.follow import FixedPointer, Follower, FollowOptions
from deltarec.serving.replica import Replica
from deltarec.stores.types import ServingPointer
from deltarec.testing.dumps import new_generation

RUN, TABLE = "bench", "sparse.ebc.item_id"


def _rows(keys: np.ndarray, dim: int, rng: np.random.Generator, deletes: float) -> ShardRows:
    ops = (rng.random(len(keys)) < deletes).astype(np.int8)
    emb = rng.standard_normal((len(keys), dim), np.float32)
    return ShardRows(keys.astype(np.int64), emb, ops, np.zeros(len(keys), np.int64))


def _dump(root, info, seq, rows, kind=DumpKind.DELTA):  # type: ignore[no-untyped-def]
    extra = {"taken_at": utc_now()}
    return write_dump(root, info, seq, kind, {TABLE: {0: rows}}, seq, seq, extra=extra)


def _quantiles(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return xs[len(xs) // 2], xs[min(len(xs) - 1, int(len(xs) * 0.99))]


def bench_apply(root, info, replica, args, rng):  # type: ignore[no-untyped-def]
    apply_rate, read_rate = [], []
    for seq in range(1, args.deltas + 1):
        keys = rng.choice(args.rows, args.delta_rows, replace=False)
        m = _dump(root, info, seq, _rows(keys, args.dim, rng, 0.05))
        t0 = time.perf_counter()
        for shard in m.shards:
            for _ in iter_shard(root, root.dump_dir(RUN, 1, seq), shard, DType.FLOAT32, 1 << 20):
                pass
        read_rate.append(args.delta_rows / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        replica.apply(m)
        apply_rate.append(args.delta_rows / (time.perf_counter() - t0))
    return statistics.median(apply_rate), statistics.median(read_rate)


def bench_lookup(replica, args, batch, rng, during_applies=None):  # type: ignore[no-untyped-def]
    device = replica.device
    with replica.pinned() as snap:
        dense = snap.table(TABLE).storage[: args.rows].clone()
    ids = [torch.from_numpy(rng.integers(0, args.rows, batch)).to(device) for _ in range(64)]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    stop = threading.Event()
    applier = None
    if during_applies is not None:
        applier = threading.Thread(target=during_applies, args=(stop,), daemon=True)
        applier.start()
    lat, base = [], []
    n = args.lookups
    for i in range(n):
        x = ids[i % len(ids)]
        t0 = time.perf_counter()
        with replica.pinned() as s:
            rows, _ = s.table(TABLE).lookup(x)
        sync()
        lat.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dense.index_select(0, x)
        sync()
        base.append(time.perf_counter() - t0)
    stop.set()
    if applier is not None:
        applier.join()
    return _quantiles(lat), _quantiles(base), rows.shape


def bench_freshness(root, info, args, rng, first_seq):  # type: ignore[no-untyped-def]
    replica = Replica(root, RUN, args.device)
    seq0 = first_seq - 1
    follower = Follower(
        replica, FixedPointer(ServingPointer(RUN, 1, seq0, 1.0)), FollowOptions(poll_s=args.poll)
    )
    follower.poll()
    follower.start()
    fresh = []
    try:
        for seq in range(first_seq, first_seq + args.fresh_dumps):
            keys = rng.choice(args.rows, args.delta_rows, replace=False)
            _dump(root, info, seq, _rows(keys, args.dim, rng, 0.05))
            deadline = time.monotonic() + 120
            while replica.current.position.seq < seq and time.monotonic() < deadline:
                time.sleep(0.005)
            v = replica.visible[-1]
            fresh.append(v.freshness_s)
            time.sleep(args.poll * rng.random())  # dumps arrive at any moment of a poll period
    finally:
        follower.stop()
    return _quantiles(fresh)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=500_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--deltas", type=int, default=8)
    p.add_argument("--delta-rows", type=int, default=50_000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--lookups", type=int, default=2000)
    p.add_argument("--batches", default="1,64,1024")
    p.add_argument("--poll", type=float, default=0.5)
    p.add_argument("--fresh-dumps", type=int, default=10)
    p.add_argument("--concurrent-dumps", type=int, default=60)
    args = p.parse_args()
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    print(f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"machine: {platform.node()} {platform.machine()} torch {torch.__version__}")
    print(f"device: {args.device}; table {args.rows} x {args.dim} float32; torch threads "
          f"{torch.get_num_threads()}")  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        root = ArtifactRoot(d)
        spec = TableSpec(dim=args.dim, dtype=DType.FLOAT32, num_embeddings=args.rows)
        info = new_generation(root, RUN, {TABLE: spec}, world_size=1)
        snap = _rows(np.arange(args.rows), args.dim, rng, 0.0)
        _dump(root, info, 0, snap, DumpKind.SNAPSHOT)
        replica = Replica(root, RUN, args.device)
        t0 = time.perf_counter()
        replica.install(replica.load(1, 0))
        print(f"load snapshot: {args.rows / (time.perf_counter() - t0):,.0f} rows/s")
        apply, read = bench_apply(root, info, replica, args, rng)
        print(f"apply: {apply:,.0f} rows/s per delta of {args.delta_rows} rows (median of "
              f"{args.deltas}); shard read alone {read:,.0f} rows/s; "
              f"apply/read {apply / read:.2f}")  # fmt: skip
        seq = [args.deltas]
        pending = []
        for _ in range(args.concurrent_dumps):  # pre-written dumps for the concurrent applier
            seq[0] += 1
            keys = rng.choice(args.rows, args.delta_rows // 5, replace=False)
            pending.append(_dump(root, info, seq[0], _rows(keys, args.dim, rng, 0.0)))
        applied = [0]

        def applier(stop: threading.Event) -> None:
            while not stop.is_set() and pending:
                replica.apply(pending.pop(0))
                applied[0] += 1

        for b in [int(x) for x in args.batches.split(",")]:
            (p50, p99), (b50, b99), _ = bench_lookup(replica, args, b, rng)
            print(f"lookup B={b:5d} idle:   p50 {p50 * 1e6:8.1f} us  p99 {p99 * 1e6:8.1f} us "
                  f"({p50 / b * 1e6:6.3f} us/id)  baseline index_select p50 {b50 * 1e6:7.1f} us "
                  f"p99 {b99 * 1e6:7.1f} us  ratio p50 {p50 / b50:.1f}x")  # fmt: skip
            before = applied[0]
            (p50, p99), (b50, b99), _ = bench_lookup(replica, args, b, rng, applier)
            print(f"lookup B={b:5d} applying: p50 {p50 * 1e6:6.1f} us  p99 {p99 * 1e6:8.1f} us "
                  f"({p50 / b * 1e6:6.3f} us/id)  baseline p50 {b50 * 1e6:7.1f} us "
                  f"p99 {b99 * 1e6:7.1f} us  "
                  f"({applied[0] - before} dumps applied meanwhile)")  # fmt: skip
        f50, f99 = bench_freshness(root, info, args, rng, seq[0] + 1)
        print(f"freshness (taken -> visible, poll {args.poll} s): p50 {f50:.3f} s  p99 {f99:.3f} s"
              f" over {args.fresh_dumps} dumps of {args.delta_rows} rows")  # fmt: skip


if __name__ == "__main__":
    main()
