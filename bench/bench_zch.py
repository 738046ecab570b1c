"""Dump cost of a ZCH table (4M slots) vs a plain table (4M rows), 100k touched ids each.

Run: ``.venv/bin/python bench/bench_zch.py [--slots N] [--touched N] [--dim N] [--intervals N]``

One process (a 1-rank gloo DMP on CPU) holds both tables: a plain EmbeddingBagCollection
table and a ManagedCollisionEmbeddingBagCollection table (MCH, LRU) whose mapping is loaded
full (every usable slot holds a raw id). Each interval trains 4 steps that touch ``touched``
distinct ids per table: for the ZCH table 90% are held ids and 10% are new raw ids, so every
interval also admits and evicts ~10% (those evicted ids are dumped too, with op=1). After each
interval each table is dumped by its own real :class:`deltarec.dump.Dumper` (sources from
:func:`deltarec.tracking.discovery.discover_sources`), and two times are taken per table:

* collect: ``dump_now`` on the training thread (find the touched rows, gather them, hand them
  to the background writer), the part that holds training up;
* dump: ``dump_now`` + ``wait_idle`` (also encode, parquet write and commit).

The first interval is a warm-up; medians over the rest are reported, with ratio ZCH / plain.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import tempfile
import time
from typing import Any

import torch
from torch import nn

STEPS_PER_INTERVAL = 4


class _Model(nn.Module):
    def __init__(self, slots: int, dim: int) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
        from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
        from torchrec.modules.mc_modules import (
            LRU_EvictionPolicy,
            ManagedCollisionCollection,
            MCHManagedCollisionModule,
        )

        def cfg(name: str) -> Any:
            return EmbeddingBagConfig(
                name=name, embedding_dim=dim, num_embeddings=slots, feature_names=[f"f_{name}"]
            )

        self.ebc = EmbeddingBagCollection([cfg("plain")], device=torch.device("meta"))
        mch = MCHManagedCollisionModule(
            zch_size=slots,
            device=torch.device("cpu"),
            eviction_policy=LRU_EvictionPolicy(),
            eviction_interval=STEPS_PER_INTERVAL,
            input_hash_size=1 << 40,
            name="zch",
        )
        zch_tables = [cfg("zch")]
        self.zch = ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(zch_tables, device=torch.device("meta")),
            ManagedCollisionCollection({"zch": mch}, zch_tables),
        )
        # A dense layer, so DMP wraps the model data-parallel (torchrec's delta tracker
        # expects that wrapper).
        self.dense = nn.Linear(dim, 1)

    def forward(self, plain: Any, zch: Any) -> torch.Tensor:
        kt, _ = self.zch(zch)
        return self.dense(self.ebc(plain).values() + kt.values()).sum()


def _kjt(name: str, ids: torch.Tensor) -> Any:
    from torchrec import KeyedJaggedTensor

    lengths = torch.ones(ids.numel(), dtype=torch.int32)
    return KeyedJaggedTensor.from_lengths_sync([f"f_{name}"], ids, lengths)


def _build(slots: int, dim: int) -> Any:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import (
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    model = _Model(slots, dim)
    sparse = [*model.ebc.parameters(), *model.zch.parameters()]
    apply_optimizer_in_backward(torch.optim.SGD, sparse, {"lr": 0.01})
    mc_sharder = ManagedCollisionEmbeddingBagCollectionSharder()
    kw: dict[str, Any] = {"local_size": 1, "world_size": 1, "device_type": "cpu"}
    plan = ShardingPlan(
        {
            "ebc": construct_module_sharding_plan(
                model.ebc, {"plain": table_wise(rank=0, compute_kernel="fused")}, **kw
            ),
            "zch": construct_module_sharding_plan(
                model.zch, {"zch": row_wise(compute_kernel="fused")}, sharder=mc_sharder, **kw
            ),
        }
    )
    sharders: list[Any] = [EmbeddingBagCollectionSharder(), mc_sharder]
    return DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)


def _fill_mapping(dmp: Any, slots: int) -> Any:
    """Load a full mapping: raw ids 0, 2, 4, ... held in random slots (like a checkpoint)."""
    mch = dmp.module.zch._managed_collision_collection._managed_collision_modules["zch"]
    with torch.no_grad():
        mch._mch_sorted_raw_ids[:-1] = torch.arange(0, 2 * (slots - 1), 2)
        mch._mch_remapped_ids_mapping[:-1] = torch.randperm(slots - 1)
    return mch


def _interval_ids(slots: int, touched: int, interval: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(interval)
    plain = torch.randperm(slots, generator=gen)[:touched]
    fresh = touched // 10
    held = torch.randperm(slots - 1, generator=gen)[: touched - fresh] * 2
    new = 2 * torch.randint(0, 1 << 38, (fresh,), generator=gen) + 1  # odd: never held
    return plain, torch.cat([held, new])[torch.randperm(touched, generator=gen)]


def _train_interval(dmp: Any, opt: Any, slots: int, touched: int, interval: int) -> float:
    """Train one interval (4 steps, ``touched`` ids per table); return its CPU seconds."""
    plain_ids, zch_ids = _interval_ids(slots, touched, interval)
    t0 = time.process_time()
    for part in range(STEPS_PER_INTERVAL):
        sl = slice(part * touched // 4, (part + 1) * touched // 4)
        opt.zero_grad()
        dmp(_kjt("plain", plain_ids[sl]), _kjt("zch", zch_ids[sl])).backward()
    return time.process_time() - t0


def _timed(dumper: Any, step: int) -> tuple[float, float, float, float]:
    """``(collect wall, collect CPU, dump wall, dump CPU)`` seconds of one dump.

    CPU seconds: the training thread's for the collect (torch runs on 1 thread here), the
    whole process's (training thread + background writer) for the dump. They do not count
    time spent waiting for a core on a shared machine.
    """
    w0, t0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
    dumper.dump_now(step)
    w1, t1 = time.perf_counter(), time.thread_time()
    dumper.wait_idle()
    return w1 - w0, t1 - t0, time.perf_counter() - w0, time.process_time() - p0


def _bench_rank(rank: int, world_size: int, args: dict[str, int], workdir: str) -> dict:
    from deltarec.dump import Dumper, DumperConfig
    from deltarec.tracking.discovery import discover_sources
    from deltarec.tracking.zch import discover_zch_sources
    from deltarec.tracking.zch.cpu import prepare_zch_for_training

    slots, touched, dim = args["slots"], args["touched"], args["dim"]
    dmp = _build(slots, dim)
    _fill_mapping(dmp, slots)
    prepare_zch_for_training(dmp, max_ids_per_step=touched)
    sources = {s.spec.kind.value: s for s in discover_sources(dmp)}
    dumpers = {}
    for kind, source in sources.items():
        cfg = DumperConfig(artifacts=workdir, run=f"bench-{kind}", snapshot=False, fsync=False)
        dumpers[kind] = Dumper(cfg, [source])
        dumpers[kind].start(step=0)
    opt = dmp.fused_optimizer
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in dumpers}
    rows: dict[str, int] = {}
    step = 0
    train_s: dict[str, list[float]] = {"tracked": [], "untracked": []}
    for interval in range(args["intervals"] + 1):
        _train_interval(dmp, opt, slots, touched, interval)
        step += STEPS_PER_INTERVAL
        order = ["plain", "zch"] if interval % 2 == 0 else ["zch", "plain"]
        for kind in order:
            timing = _timed(dumpers[kind], step)
            if interval > 0:
                times[kind].append(timing)
    for kind, dumper in dumpers.items():
        assert dumper.generation is not None
        gen, run = dumper.generation.generation, dumper.config.run
        counts = [
            dumper.root.read_manifest(run, gen, seq).tables.get(sources[kind].table_id, 0)
            for seq in range(2, args["intervals"] + 2)  # dump 1 was the warm-up
        ]
        rows[kind] = int(statistics.median(counts))
        dumper.close()
    # Training cost of the ZCH tracking alone: alternate intervals with and without an open
    # ZCH source (the dumpers, and so the plain tracking, are closed by now).
    for interval in range(args["intervals"] + 1, 3 * args["intervals"] + 1):
        zch_sources = discover_zch_sources(dmp) if interval % 2 else []
        seconds = _train_interval(dmp, opt, slots, touched, interval)
        for source in zch_sources:
            source.collect()
            source.close()
        train_s["tracked" if zch_sources else "untracked"].append(seconds)
    return {"times": times, "rows": rows, "train_s": train_s}


def main() -> None:
    from deltarec.testing.multiprocess import run_on_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, default=4_000_000)
    p.add_argument("--touched", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--intervals", type=int, default=5)
    a = vars(p.parse_args())
    with tempfile.TemporaryDirectory(prefix="bench-zch-") as workdir:
        (result,) = run_on_ranks(_bench_rank, 1, args=(a, workdir), timeout_s=1800, threads=1)
    times = result["times"]
    med = {k: [statistics.median(t[i] for t in ts) for i in range(4)] for k, ts in times.items()}
    print(f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}")
    print(f"machine: {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}")
    print(
        f"tables: {a['slots']:,} rows x dim {a['dim']} float32; {a['touched']:,} touched ids "
        f"per interval ({STEPS_PER_INTERVAL} steps); 1 torch thread; medians of "
        f"{a['intervals']} intervals"
    )
    heads = ("rows/dump", "collect wall", "collect CPU", "dump wall", "dump CPU")
    print(f"{'table':<8}" + "".join(f"{h:>14}" for h in heads))
    for kind in ("plain", "zch"):
        cells = [f"{result['rows'][kind]:>14,}"] + [f"{v:>13.3f}s" for v in med[kind]]
        print(f"{kind:<8}" + "".join(cells))
    ratios = [med["zch"][i] / med["plain"][i] for i in range(4)]
    print(f"{'zch/plain':<8}{'':>14}" + "".join(f"{r:>13.2f}x" for r in ratios))
    for kind in ("plain", "zch"):
        each = " ".join(f"{t[1]:.3f}" for t in times[kind])
        print(f"collect CPU s per interval, {kind}: {each}")
    tracked, untracked = (statistics.median(result["train_s"][k]) for k in ("tracked", "untracked"))
    print(
        f"training CPU s per interval (4 steps, both tables; medians): {tracked:.3f} with a "
        f"ZCH source open, {untracked:.3f} without ({tracked / untracked:.2f}x)"
    )


if __name__ == "__main__":
    main()
