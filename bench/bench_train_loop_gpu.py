"""A GPU training loop with deltarec's hook, against the same loop without it, in one process.

The loop a user of plain CUDA tables runs: three fp32 tables (default 50M x 128, 20M x 64,
10M x 128) as plain tensors, a bf16 MLP over the sum-pooled lookups, sparse SGD on the tables
by ``index_add_``, dense SGD on the MLP, and the step's loss read on the host every step (as a
loop that logs it does; that read is where the step's time ends). The hook is attached as
docs/api.md shows (``hook_from_env`` with one ``RowShardSource`` per table behind a
``ManualTracker`` / ``TrackerHub``, the default host budget) with a dump every ``--every``
steps (default 50, the stress line) or every ``--every-s`` seconds (the clock cadence).

Blocks of steps without the hook (no ids recorded, no ``after_step``) and with it alternate in
the same process, for each loop (``--loops``: ``20ms``, a ~20 ms step; ``2ms``, a ~2 ms step
of a smaller batch and MLP; the MLP's depth is calibrated to the step time) and each id
distribution (``--ids``: ``hot``, Zipf s=1.1 over each table, scattered; ``uniform``).
Reported per loop and ids: mean / median / p99 / max step time without and with the hook
(the dump steps apart), the dump step's time, the hold (``Dumper.dump_seconds``: CUDA events),
each dump's commit latency (MANIFEST.json's mtime minus the dump's ``taken_at``), the garbage
collections seen per block kind, and per dump whether every committed row equals the table
at the dump step (rows gathered by the benchmark itself at that step, outside the timed
steps, compared bit for bit with the shards; the keys must be exactly the rows touched).

After each block with the hook the dumper is drained (``wait_idle``, untimed and reported)
and its dumps are checked, so a block without the hook never runs beside dump work. At a
cadence of more steps than a block, ``--first-dump-at K`` puts the first dump K hooked steps
in (the cadence then continues from it), so that a dump falls inside a block and the steps
after it are timed; ``--base-steps`` shortens the blocks without the hook. The targets
printed are the stress line's (mean <= 1.03x, p99 <= 1.10x) below a dump every 1,000 steps,
else the realistic cadences' (mean <= 1.01x, p99 <= 1.05x); both ask for no non-dump step over
2x the median and a dump step <= 1.5x a normal one. The summaries are in
``bench/train_loop_stats.py``.

``--compact-every-dumps N`` sets ``DumperConfig.compact_every_dumps`` (rank 0's background
compaction, :mod:`deltarec.dump.compactor`) and adds a third block to each round: with the
hook and the compactor counting commits (in the other hooked blocks it does not: no
compaction runs there). After such a block the compaction still running is waited for
(untimed); its normal steps are split by the compactor's ``spans`` into those that overlapped
a compaction and those that did not, and reported against the hooked blocks without
compaction, with each compaction's duration. The dumps are then kept (the compaction reads
the generation's lineage), so the disk must hold every dump of the run.

    python bench/bench_train_loop_gpu.py [--tables 50000000x128,20000000x64,10000000x128]
        [--loops 20ms,2ms] [--ids hot,uniform] [--rounds 2] [--dir /tmp] [--json out.json]
        [--every 50 | --every-s 30] [--steps N] [--base-steps N] [--first-dump-at K]
        [--encoder auto|thread|process] [--encode-workers N] [--compact-every-dumps N]

Realistic cadences, e.g.: ``--loops 2ms --every 1000 --steps 1000 --first-dump-at 500``;
``--loops 20ms --every 1000 --steps 1500 --base-steps 500 --first-dump-at 1000 --rounds 1``;
``--every-s 30``.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import io
import json
import os
import platform
import pstats
import shutil
import signal
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # train_loop_stats

import numpy as np
import pyarrow.parquet as pq
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
from deltarec.artifacts import ArtifactRoot
from deltarec.tracking.groups import graph_metrics
from train_loop_stats import (
    REALISTIC,
    STRESS,
    report,
    report_compaction,
    summarize,
    summarize_compaction,
)

LOOPS = {  # batch, ids per sample per table, MLP width, target step ms, steps per block
    "20ms": (4096, 16, 4096, 20.0, 300),
    "2ms": (256, 4, 1024, 2.0, 1000),
}
EVERY = 50
REF_CHUNK = 1 << 20  # rows gathered at once for the reference (device memory stays small)
CHECK_BATCH = 1 << 18  # rows of a shard compared at once (host memory stays small)
SCRAMBLE = 2654435761  # odd and not a multiple of 5: a bijection mod 2^a 5^b rows


@dataclass
class Loop:
    """The model and its step, for one loop preset."""

    tables: dict[str, torch.Tensor]
    batch: int
    bag: int
    mlp: torch.nn.Sequential
    dev: torch.device
    lr: float = 1e-3

    def ids(self, kind: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
        out = {}
        for name, w in self.tables.items():
            rows, n = w.shape[0], self.batch * self.bag
            if kind == "uniform":
                out[name] = torch.randint(0, rows, (n,), device=self.dev, generator=gen)
                continue
            u = torch.rand(n, device=self.dev, generator=gen, dtype=torch.float64)
            s = 1.1  # Zipf over [1, rows]: inverse CDF of p(r) ~ r^-s
            r = (1 + u * (rows ** (1 - s) - 1)) ** (1 / (1 - s))
            out[name] = (r.long() - 1) * SCRAMBLE % rows
        return out

    def step(self, ids: dict[str, torch.Tensor]) -> float:
        leaves, pooled = [], []
        for name, w in self.tables.items():
            rows = w.index_select(0, ids[name]).requires_grad_()
            leaves.append(rows)
            pooled.append(rows.view(self.batch, self.bag, -1).sum(1))
        x = torch.cat(pooled, 1).to(torch.bfloat16)
        loss = self.mlp(x).float().square().mean()
        loss.backward()
        with torch.no_grad():
            for (name, w), leaf in zip(self.tables.items(), leaves, strict=True):
                assert leaf.grad is not None
                w.index_add_(0, ids[name], leaf.grad, alpha=-self.lr)
            for p in self.mlp.parameters():
                assert p.grad is not None
                p.add_(p.grad, alpha=-self.lr)
                p.grad = None
        return float(loss.item())  # the host reads the loss: the step ends here


def make_mlp(width: int, layers: int, inp: int, dev: torch.device) -> torch.nn.Sequential:
    mods: list[torch.nn.Module] = [torch.nn.Linear(inp, width), torch.nn.ReLU()]
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    mods.append(torch.nn.Linear(width, 1))
    return torch.nn.Sequential(*mods).to(dev, torch.bfloat16)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_steps(loop: Loop, kind: str, n: int, gen: torch.Generator) -> float:
    sync(loop.dev)
    t0 = time.perf_counter()
    for _ in range(n):
        loop.step(loop.ids(kind, gen))
    return (time.perf_counter() - t0) / n


def calibrate(tables: dict[str, torch.Tensor], preset: str, dev: torch.device) -> Loop:
    """The loop of ``preset`` with as many MLP layers as make its target step time."""
    batch, bag, width, target_ms, _ = LOOPS[preset]
    inp = sum(w.shape[1] for w in tables.values())
    gen = torch.Generator(device=dev).manual_seed(1)
    per = {}
    for layers in (1, 5):
        loop = Loop(tables, batch, bag, make_mlp(width, layers, inp, dev), dev)
        time_steps(loop, "uniform", 5, gen)
        per[layers] = time_steps(loop, "uniform", 20, gen) * 1e3
    slope = max((per[5] - per[1]) / 4, 1e-3)
    layers = max(1, round(1 + (target_ms - per[1]) / slope))
    return Loop(tables, batch, bag, make_mlp(width, layers, inp, dev), dev)


class GcLog:
    """Garbage collections while enabled: (generation, seconds), from ``gc.callbacks``."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []
        self._t0 = 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seen.append((info["generation"], time.perf_counter() - self._t0))

    def take(self) -> list[tuple[int, float]]:
        out, self.seen = self.seen, []
        return out


class Bench:
    """One process: the tables, the hook attached once, blocks run on demand."""

    def __init__(self, a: argparse.Namespace, dev: torch.device, work: str) -> None:
        self.dev = dev
        self.work = work
        torch.manual_seed(0)
        self.tables: dict[str, torch.Tensor] = {}
        for i, spec in enumerate(a.tables.split(",")):
            rows, dim = (int(x) for x in spec.split("x"))
            w = torch.empty(rows, dim, dtype=torch.float32, device=dev).uniform_(-0.05, 0.05)
            self.tables[f"t{i}"] = w
        self.tracker = ManualTracker()
        hub = TrackerHub(self.tracker, set(self.tables))

        def sources(model: Any) -> list[RowShardSource]:
            return [
                RowShardSource(
                    f"model.{name}",
                    TableSpec(dim=w.shape[1], kind=TableKind.PLAIN, num_embeddings=w.shape[0]),
                    hub,
                    name,
                    w,
                    row_offset=0,
                )
                for name, w in self.tables.items()
            ]

        self.every = None if a.every_s else a.every
        env = TrainSettings(
            artifacts=work,
            run="bench",
            dump_every_steps=self.every,
            dump_every_minutes=a.every_s / 60 if a.every_s else None,
        ).to_env()
        options: dict[str, Any] = {"encoder": a.encoder}
        if a.encode_workers:
            options["encode_workers"] = a.encode_workers
        if a.chunk_rows:
            options["chunk_rows"] = a.chunk_rows
        if a.compact_every_dumps:
            options["compact_every_dumps"] = a.compact_every_dumps
        if a.spread_steps:
            options["spread_steps"] = a.spread_steps
        self.hook = hook_from_env(sources=sources, environ=env, **options)
        t0 = time.perf_counter()
        self.hook.on_start(torch.nn.Module(), step=0, restored_from=None)
        self.start_s = time.perf_counter() - t0
        self.hook_step = self.last_dump = 0
        if self.every and a.first_dump_at:  # the first dump after that many hooked steps
            self.hook_step = self.last_dump = self.every - a.first_dump_at
        self.gc = GcLog()
        self.touched = {
            n: torch.zeros(w.shape[0], dtype=torch.bool, device=dev) for n, w in self.tables.items()
        }
        self.root = ArtifactRoot(work)
        self.probe = Probe(a.profile_dumps, a.sync_debug)
        self.compactor = self.dumper.compactor
        self._compacting(False)  # the compactor counts commits only in compaction blocks

    def _compacting(self, on: bool) -> None:
        if self.compactor is not None:
            self.dumper._worker.after_commit = self.compactor.committed if on else None

    @property
    def dumper(self) -> Any:
        return self.hook.dumper

    def block(
        self,
        loop: Loop,
        kind: str,
        n: int,
        hooked: bool,
        gen: torch.Generator,
        compacting: bool = False,
    ) -> dict:
        steps, dump_steps, refs, offsets, dump_at, spans = [], [], {}, [], [], []
        parts: list[tuple[float, float, float]] = []  # a normal step's record / step / after
        absorbs: list[float] = []  # after_step of the steps that marked the recorded lookups
        plain: list[float] = []  # after_step of the other normal steps
        d = self.dumper
        graphed = graph_metrics(d.sources)["graphed"]
        self._compacting(compacting)
        done = len(self.compactor.spans) if self.compactor is not None else 0
        for _ in range(n):
            ids = loop.ids(kind, gen)
            sync(self.dev)
            t0 = time.perf_counter()
            if hooked:
                for name, x in ids.items():
                    self.tracker.record(name, x)
            t1 = time.perf_counter()
            loop.step(ids)
            t2 = time.perf_counter()
            taken = d.dumps_taken
            if hooked:
                self.hook_step += 1
                self.probe.after_step(self.hook, self.hook_step)
            t3 = time.perf_counter()
            sync(self.dev)
            ms = (time.perf_counter() - t0) * 1e3
            if hooked:
                for name, x in ids.items():
                    self.touched[name][x] = True
            if d.dumps_taken > taken:
                dump_steps.append(ms)
                dump_at.append(self.hook_step)
                self.last_dump = self.hook_step
                refs[d._seq] = self._reference()  # untimed: the rows at the dump step
            else:
                steps.append(ms)
                parts.append((t1 - t0, t2 - t1, t3 - t2))
                if hooked:
                    (absorbs if d._since_absorb == 0 else plain).append(t3 - t2)
                spans.append((t0, t0 + ms / 1e3))
                offsets.append(self.hook_step - self.last_dump if hooked else -1)
        out = {"steps": steps, "dump_steps": dump_steps, "offsets": offsets, "gc": self.gc.take()}
        # where a normal step's host time went (no sync added): the record calls, the step
        # itself (its GPU wait included, loss.item()), after_step
        cols = zip(*parts, strict=True)
        out["parts_ms"] = [float(np.mean(c)) * 1e3 for c in cols] if parts else []
        out["after_ms"] = {  # after_step: marking steps against the others
            "absorb": float(np.mean(absorbs)) * 1e3 if absorbs else 0.0,
            "absorb_n": len(absorbs),
            "other": float(np.mean(plain)) * 1e3 if plain else 0.0,
        }
        out["dump_at"] = dump_at
        out["graphed"] = graph_metrics(d.sources)["graphed"] - graphed
        out["dump_wall"] = list(d.dump_host_seconds)[-len(dump_steps) :] if dump_steps else []
        out["dump_cpu"] = list(d.dump_cpu_seconds)[-len(dump_steps) :] if dump_steps else []
        k = len(dump_steps)
        out["dump_prepare"] = PREPARED[-k:] if k else []
        out["dump_tables"] = [sum(t.values()) for t in list(d.dump_timings)[-k:]] if k else []
        if hooked:
            t0 = time.perf_counter()
            d.wait_idle()
            out["drain_s"] = time.perf_counter() - t0
            out["checks"] = [self._check(seq, ref) for seq, ref in refs.items()]
        if compacting:
            out["step_spans"] = spans
            out["compactions"] = self._wait_compactor(done)
        self._compacting(False)
        return out

    def _wait_compactor(self, done: int, timeout: float = 90.0) -> dict:
        """The compactions since ``done`` spans, after the one still running ended (untimed)."""
        c = self.compactor
        assert c is not None
        t0, quiet = time.perf_counter(), 0
        while quiet < 4 and time.perf_counter() - t0 < timeout:
            busy = c._want is not None or c.running_since is not None
            quiet = 0 if busy else quiet + 1
            time.sleep(0.05)
        spans = list(c.spans)[done:]
        if c.running_since is not None:  # still running at the timeout: open until now
            spans.append((c.running_since, time.perf_counter()))
        return {"spans": spans, "wait_s": time.perf_counter() - t0, "failures": c.failures}

    def _reference(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Every touched row at the dump step, in host memory (sorted ids, their rows)."""
        ref = {}
        for name, w in self.tables.items():
            ids = self.touched[name].nonzero().reshape(-1)
            rows = torch.empty((len(ids), w.shape[1]), dtype=w.dtype)
            for s in range(0, len(ids), REF_CHUNK):
                rows[s : s + REF_CHUNK] = w.index_select(0, ids[s : s + REF_CHUNK]).cpu()
            ref[name] = (ids.cpu().numpy(), rows.numpy())
            self.touched[name].zero_()
        return ref

    def _check(self, seq: int, ref: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict:
        """Whether the committed dump ``seq`` holds exactly the reference's keys, bit for bit."""
        t0 = time.perf_counter()
        gen = self.dumper.generation.generation
        m = self.root.read_manifest("bench", gen, seq)
        dump_dir = self.root.dump_dir("bench", gen, seq)
        latency = os.stat(os.path.join(dump_dir, "MANIFEST.json")).st_mtime - _taken_at(m)
        ok, rows = True, 0
        for name, (ids, want) in ref.items():
            found = np.zeros(len(ids), dtype=bool)
            for s in (s for s in m.shards if s.table == f"model.{name}"):
                f = pq.ParquetFile(os.path.join(dump_dir, s.path))
                for t in f.iter_batches(CHECK_BATCH, columns=["key", "embedding"]):
                    keys = t.column("key").to_numpy()
                    if not len(keys):
                        continue
                    emb = t.column("embedding").flatten().to_numpy()
                    pos = np.minimum(np.searchsorted(ids, keys), max(len(ids) - 1, 0))
                    same = len(ids) > 0 and bool((ids[pos] == keys).all())
                    same = same and not found[pos].any()  # no key twice: across batches
                    same = same and len(np.unique(pos)) == len(pos)  # and within one
                    got = emb.reshape(len(keys), -1).view(np.uint32)
                    ok = ok and same and np.array_equal(want[pos].view(np.uint32), got)
                    found[pos] = True
                    rows += len(keys)
            ok = ok and bool(found.all())
        if self.compactor is None:  # keep the disk from filling; the manifest was read
            shutil.rmtree(dump_dir)  # (a compaction reads the lineage: then every dump stays)
        return {
            "seq": seq,
            "rows": rows,
            "ok": ok,
            "commit_s": latency,
            "check_s": time.perf_counter() - t0,
        }


PREPARED: list[float] = []
"""Training-thread seconds of each dump's ``prepare_collects`` (every table's deduplication
queued), timed around the dumper's call."""


def _time_prepare() -> None:
    import deltarec.dump.dumper as dumper_module

    inner = dumper_module.prepare_collects

    def timed(sources: Any) -> None:
        t0 = time.perf_counter()
        inner(sources)
        PREPARED.append(time.perf_counter() - t0)

    dumper_module.prepare_collects = timed


class Probe:
    """Calls ``after_step``, optionally under cProfile and CUDA's sync debug mode.

    ``profile``: every ``after_step`` of the training thread runs under one cProfile profile
    (the dump steps dominate it), printed by :meth:`report`. ``sync_debug``: the host
    synchronizations CUDA reports inside ``after_step`` (``torch.cuda.set_sync_debug_mode``)
    are counted per call site.
    """

    def __init__(self, profile: bool, sync_debug: bool) -> None:
        self.prof = cProfile.Profile() if profile else None
        self.sync_debug = sync_debug
        self.syncs: dict[str, int] = {}
        self.calls = 0

    def after_step(self, hook: Any, step: int) -> None:
        self.calls += 1
        if not self.sync_debug and self.prof is None:
            hook.after_step(step)  # as a training loop calls it: nothing around it
            return
        if self.sync_debug:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                if self.prof is not None:
                    self.prof.enable()
                try:
                    hook.after_step(step)
                finally:
                    if self.prof is not None:
                        self.prof.disable()
        finally:
            if self.sync_debug:
                torch.cuda.set_sync_debug_mode(0)
        for w in seen:
            if "synchroniz" in str(w.message):
                where = f"{os.path.basename(w.filename)}:{w.lineno}"
                self.syncs[where] = self.syncs.get(where, 0) + 1
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {"after_step_calls": self.calls}
        if self.sync_debug:
            out["syncs"] = self.syncs
            print(f"host synchronizations inside after_step: {self.syncs or 'none'}")
        if self.prof is not None:
            text = io.StringIO()
            for order in ("tottime", "cumulative"):
                pstats.Stats(self.prof, stream=text).sort_stats(order).print_stats(30)
            out["profile"] = text.getvalue()
            print(text.getvalue())
        return out


def _taken_at(m: Any) -> float:
    text = m.extra["taken_at"]
    when = datetime.datetime.strptime(str(text), "%Y-%m-%dT%H:%M:%S.%fZ")
    return when.replace(tzinfo=datetime.timezone.utc).timestamp()


def set_children_policy(name: str) -> dict[int, int]:
    """Move every thread of this process's children to scheduling policy ``name``."""
    policy = {"idle": os.SCHED_IDLE, "batch": os.SCHED_BATCH}[name]
    moved: dict[int, int] = {}
    me = str(os.getpid())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = f.read().rsplit(")", 1)[1].split()[1]
            if ppid != me:
                continue
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))
        moved[int(pid)] = len(tids)
    print(f"encoder threads moved to SCHED_{name.upper()}: {moved}", flush=True)
    return moved


def run_config(
    a: argparse.Namespace,
    bench: Bench,
    loop: Loop,
    kind: str,
    n: int,
    gen: torch.Generator,
    began: float,
) -> tuple[list[dict], list[float]]:
    """Rounds of blocks: without the hook, then with it."""
    d = bench.dumper
    runs: list[dict] = []
    holds: list[float] = []
    for rnd in range(a.rounds):
        if time.perf_counter() - began > a.time_budget_s:
            print(f"time budget reached: {kind} round {rnd} skipped", flush=True)
            break
        modes = [(False, False), (True, False)] + [(True, True)] * bool(a.compact_every_dumps)
        for hooked, compacting in modes:
            before = len(d.dump_seconds)
            steps = n if hooked else a.base_steps or n
            r = bench.block(loop, kind, steps, hooked, gen, compacting)
            r["hooked"], r["compacting"] = hooked, compacting
            runs.append(r)
            if not compacting:  # the summary's holds: the blocks it summarizes
                holds += list(d.dump_seconds)[before:]
    return runs, holds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tables", default="50000000x128,20000000x64,10000000x128")
    p.add_argument("--loops", default="20ms,2ms")
    p.add_argument("--ids", default="hot,uniform")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=None, help="steps per block (default: preset)")
    p.add_argument("--base-steps", type=int, default=None, help="without the hook (--steps)")
    p.add_argument("--every", type=int, default=EVERY, help="steps between dumps")
    p.add_argument("--every-s", type=float, default=None, help="seconds between dumps")
    p.add_argument(
        "--first-dump-at", type=int, default=None, help="hooked steps before the first dump"
    )
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--time-budget-s", type=float, default=540.0)
    p.add_argument("--encode-workers", type=int, default=None, help="DumperConfig")
    p.add_argument(
        "--chunk-rows", type=int, default=None, help="DumperConfig: rows a copy to host holds"
    )
    p.add_argument(
        "--absorb-steps",
        type=int,
        default=None,
        help="steps between the dumper's markings of recorded lookups (ABSORB_STEPS)",
    )
    p.add_argument(
        "--compact-every-dumps",
        type=int,
        default=None,
        help="DumperConfig.compact_every_dumps, in a third hooked block each round",
    )
    p.add_argument(
        "--spread-steps",
        type=int,
        default=None,
        help="DumperConfig.spread_steps: read each dump's rows over the steps after it",
    )
    p.add_argument(
        "--encoder", default="auto", choices=["auto", "thread", "process"], help="DumperConfig"
    )
    p.add_argument(
        "--switch-interval-ms", type=float, default=None, help="sys.setswitchinterval (GIL)"
    )
    p.add_argument(
        "--encoder-sched",
        default=None,
        choices=["idle", "batch"],
        help="move every thread of the encoder process to SCHED_IDLE or SCHED_BATCH",
    )
    p.add_argument(
        "--profile-dumps", action="store_true", help="cProfile the training thread's after_step"
    )
    p.add_argument(
        "--sync-debug", action="store_true", help="count host synchronizations in after_step"
    )
    a = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: the dumps are removed
    if a.switch_interval_ms is not None:
        sys.setswitchinterval(a.switch_interval_ms / 1e3)
    if a.absorb_steps is not None:
        import deltarec.dump.dumper as dumper_module

        dumper_module.ABSORB_STEPS = a.absorb_steps  # type: ignore[misc]
    began = time.perf_counter()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    work = tempfile.mkdtemp(prefix="deltarec-train-loop-", dir=a.dir)
    res: dict[str, Any] = {
        "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        "machine": f"{platform.node()} ({os.cpu_count()} cores), "
        + (torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "switch_interval_s": sys.getswitchinterval(),
        "encoder": a.encoder,
        "encode_workers": a.encode_workers,
        "chunk_rows": a.chunk_rows,
        "absorb_steps": a.absorb_steps,
        "every": None if a.every_s else a.every,
        "every_s": a.every_s,
        "encoder_sched": a.encoder_sched,
        "compact_every_dumps": a.compact_every_dumps,
        "spread_steps": a.spread_steps,
        "tables": a.tables,
        "results": {},
    }
    _time_prepare()
    bench = Bench(a, dev, work)
    if a.encoder_sched:
        res["encoder_threads_moved"] = set_children_policy(a.encoder_sched)
    d = bench.dumper
    res["on_start_s"] = bench.start_s
    res["host_budget"] = d.host_budget
    res["plan"] = vars(d.plan) if hasattr(d.plan, "__dict__") else str(d.plan)
    res["pinned"] = d.pinned.nbytes if d.pinned is not None else 0
    res["snapshot_written"] = bool(bench.root.list_dumps("bench", d.generation.generation))
    print(
        f"on_start {bench.start_s:.2f} s, host budget {d.host_budget / 2**30:.2f} GiB, "
        f"pinned ring {res['pinned'] / 2**20:.0f} MiB, snapshot: {res['snapshot_written']}",
        flush=True,
    )
    targets = REALISTIC if a.every_s or a.every >= 1000 else STRESS
    try:
        for preset in a.loops.split(","):
            loop = calibrate(bench.tables, preset, dev)
            n = a.steps or LOOPS[preset][4]
            gen = torch.Generator(device=dev).manual_seed(2)
            time_steps(loop, "uniform", 20, gen)  # warm-up
            for kind in a.ids.split(","):
                runs, holds = run_config(a, bench, loop, kind, n, gen, began)
                if not any(r["hooked"] for r in runs):
                    continue
                s = summarize([r for r in runs if not r["compacting"]], holds, targets)
                s["mlp_layers"] = (len(loop.mlp) - 3) // 2
                s["block_steps"] = {"with": n, "without": a.base_steps or n}
                res["results"][f"{preset}/{kind}"] = s
                report(f"{preset}/{kind}", s)
                if a.compact_every_dumps:
                    s["compaction"] = summarize_compaction(runs)
                    report_compaction(s["compaction"])
                if a.json:
                    with open(a.json, "w") as f:
                        json.dump(res, f, indent=1, default=str)
    finally:
        res["device_staging"] = d.device_budget.metrics() | graph_metrics(d.sources)
        bench.hook.close()  # no final dump: nothing of it is measured
        shutil.rmtree(work, ignore_errors=True)
    res["probe"] = bench.probe.report()
    print(f"device staging and graphs: {res['device_staging']}")
    res["total_s"] = time.perf_counter() - began
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
