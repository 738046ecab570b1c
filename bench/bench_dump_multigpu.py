"""Dumps on several ranks, one per GPU (NCCL), or on CPU ranks (gloo): checked, timed, killed.

Run under torchrun, one process per GPU (``--nproc-per-node 2`` on a 2-GPU host, ``1`` on one
GPU), or on CPU ranks where CUDA is absent (gloo default group)::

    torchrun --standalone --nproc-per-node 2 bench/bench_dump_multigpu.py [--json out.json]

Two plain tables (``bench.item`` 64 wide, ``bench.user`` 32 wide) are row-sharded by hand:
rank r holds the r-th block of rows, a ``RowShardSource`` over a ``ManualTracker``. A training
step looks up a skewed batch of local rows per table, updates them (``index_add_``) and
all-reduces a dense gradient on the default group, as a data-parallel dense part would. The
dumper is driven through deltarec's hook (``DumpHook``) with a step and a minute cadence. Phases:

1. **timing**: step time without and with the hook, alternating step by step on two copies of
   the tables (each step synchronized on the device, both sides alike).
2. **gen1**: generation 1 (snapshot, step and minute dumps: two slow steps force time dumps), a
   checkpoint (tables + hook state) half-way, the final dump. Every committed dump's rows on
   every rank equal the sharded table's rows at its dump step (keys: the rows touched since
   the previous dump; the snapshot: every row), and their ``step`` column is the dump step.
3. **gen2**: restore from the checkpoint: generation 2 (parent = generation 1 at the
   checkpoint step) republishes (dump 1) every key generation 1 dumped after the checkpoint
   with its checkpoint value; training goes on; its dumps are checked as in gen1.
4. **kill**, **kill_alone** (2 ranks or more): each rank starts a child process (same GPU)
   that joins a new process group and trains with the hook; the last rank's child is held in
   the middle of its second dump's shard write and killed with SIGKILL. Every other child
   must stop with an error within ``--kill-bound`` seconds (no hang); the error and what
   deltarec's worker saw are reported. In ``kill`` a step all-reduces the dense gradient
   (on gloo that fails first; on NCCL it hangs on the device, and the group's timeout, the
   watchdog, bounds it); in ``kill_alone`` it does not, and deltarec's error must stop it.

deltarec's collectives run on its own gloo groups beside the default group (docs/dump.md);
the ``exchanges`` field shows them. Rank 0 prints a JSON summary; every rank exits 1 if any
check failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np
import torch
import torch.distributed as dist

from deltarec.artifacts import ArtifactRoot, TableKind, TableSpec, codec, read_shard
from deltarec.dump import DumperConfig
from deltarec.dump.hook import DumpHook
from deltarec.ports import free_port
from deltarec.tracking.plain import RowShardSource
from deltarec.tracking.tracker import ManualTracker, TrackerHub

TABLES = {"bench.item": 64, "bench.user": 32}


# ---- the hand-sharded model -------------------------------------------------------------
class Shards:
    """This rank's row block of every table, its tracker, and the rows touched since a dump."""

    def __init__(self, rows: int, rank: int, world: int, device: torch.device, seed: int) -> None:
        self.device = device
        self.local = rows // world
        self.offset = rank * self.local
        gen = torch.Generator(device="cpu").manual_seed(seed * 1000 + rank)
        self.weights = {
            t: torch.rand(self.local, dim, generator=gen).sub_(0.5).to(device)
            for t, dim in TABLES.items()
        }
        self.touched = {t: torch.zeros(self.local, dtype=torch.bool, device=device) for t in TABLES}
        self.tracker = ManualTracker()
        self.hub = TrackerHub(self.tracker, set(TABLES))
        self.gen = torch.Generator(device=device).manual_seed(seed * 7919 + rank)

    def sources(self) -> list[RowShardSource]:
        """One row-block source per table (global key = local row + this rank's offset)."""
        out = []
        for t, w in self.weights.items():
            spec = TableSpec(
                dim=w.shape[1],
                kind=TableKind.PLAIN,
                num_embeddings=self.local * dist_world(),
                sharding="row_wise",
            )
            out.append(RowShardSource(t, spec, self.hub, t, w, self.offset))
        return out

    def step(self, batch: int, dense: torch.Tensor | None, record: bool = True) -> None:
        """Look up a skewed batch per table, update those rows, all-reduce the dense grad."""
        for t, w in self.weights.items():
            u = torch.rand(batch, generator=self.gen, device=self.device)
            ids = (u.pow(3) * self.local).long().clamp_(max=self.local - 1)
            grad = w.index_select(0, ids).mul(0.01).add_(0.001)
            w.index_add_(0, ids, grad, alpha=-1.0)
            if record:
                self.tracker.record(t, ids)
                self.touched[t][ids] = True
        if dense is not None and dist_world() > 1:
            dist.all_reduce(dense)
            dense.mul_(1.0 / dist_world())

    def take_touched(self, every_row: bool = False) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """``{table: (global keys ascending, rows)}`` touched since the last call (or all)."""
        out = {}
        for t, w in self.weights.items():
            mask = self.touched[t]
            local = (
                torch.arange(self.local, device=self.device)
                if every_row
                else mask.nonzero().squeeze(1)
            )
            out[t] = ((local + self.offset).cpu().numpy(), w.index_select(0, local).cpu().numpy())
            mask.zero_()
        return out


def dist_world() -> int:  # 1 outside torchrun
    return dist.get_world_size() if dist.is_initialized() else 1


def dist_rank() -> int:  # 0 outside torchrun
    return dist.get_rank() if dist.is_initialized() else 0


def make_hook(a: argparse.Namespace, root: str, run: str, shards: Shards, **cfg: Any) -> DumpHook:
    config = DumperConfig(
        artifacts=root,
        run=run,
        every_steps=a.every,
        every_minutes=a.minutes,
        fsync=False,
        commit_timeout_s=a.pg_timeout,
        **cfg,
    )
    return DumpHook(config, sources=lambda model: shards.sources())


def sync(device: torch.device) -> None:  # each timed step ends with the device idle
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- phase 1: step time with and without the hook ----------------------------------------
def phase_timing(a: argparse.Namespace, work: str, device: torch.device) -> dict[str, Any]:
    rank, world = dist_rank(), dist_world()
    bare = Shards(a.rows, rank, world, device, a.seed)
    hooked = Shards(a.rows, rank, world, device, a.seed)
    dense = torch.zeros(a.dense, device=device)
    hook = make_hook(a, f"{work}/art", "timing", hooked, snapshot=False)
    hook.on_start(torch.nn.Module(), 0, None)
    t_bare, t_hook = [], []
    try:
        for step in range(1, a.timing_steps + 1):
            sync(device)
            t0 = time.perf_counter()
            bare.step(a.batch, dense, record=False)
            sync(device)
            t1 = time.perf_counter()
            hooked.step(a.batch, dense)
            hook.after_step(step)
            sync(device)
            t2 = time.perf_counter()
            if step > 10:  # warm-up
                t_bare.append(t1 - t0)
                t_hook.append(t2 - t1)
        hook.on_end(a.timing_steps)
        dumper = hook.dumper
        assert dumper is not None
        dumps, syncs = dumper.dumps_taken, dumper._cadence.syncs if dumper._cadence else 0
        holds = list(dumper.dump_seconds)
    finally:
        hook.close()
    return {
        "steps": len(t_bare),
        "bare_mean_ms": statistics.mean(t_bare) * 1e3,
        "bare_median_ms": statistics.median(t_bare) * 1e3,
        "hook_mean_ms": statistics.mean(t_hook) * 1e3,
        "hook_median_ms": statistics.median(t_hook) * 1e3,
        "ratio_of_means": statistics.mean(t_hook) / statistics.mean(t_bare),
        "dumps": dumps,
        "clock_agreements": syncs,
        "dump_hold_median_ms": statistics.median(holds) * 1e3 if holds else None,
    }


# ---- phases 2 and 3: generations, checkpoint, restore, checks ----------------------------
def train_generation(
    a: argparse.Namespace,
    shards: Shards,
    hook: DumpHook,
    first: int,
    last: int,
    dense: torch.Tensor,
    slow: tuple[int, ...] = (),
    ckpt_step: int | None = None,
    ckpt_path: str | None = None,
) -> dict[int, dict[str, Any]]:
    """Steps ``first..last`` with the hook; the oracle of every dump, keyed by seq.

    ``slow``: after the deltas of these seqs, the next step is slow (a data stall longer than
    the minute cadence's interval), so the clock agreement right after it dumps by time.
    """
    dumper = hook.dumper
    assert dumper is not None
    oracle: dict[int, dict[str, Any]] = {}
    if dumper.dumps_taken:  # the snapshot at on_start
        oracle[0] = {"step": first - 1, "rows": shards.take_touched(every_row=True)}
    taken = dumper.dumps_taken
    for step in range(first, last + 1):
        shards.step(a.batch, dense)
        if dumper.state_dict()["seq"] in slow and dumper.state_dict()["last_dump_step"] == step - 1:
            time.sleep(a.minutes * 60 * 1.3)  # a stall: the minute cadence's deadline passes
        hook.after_step(step)
        if dumper.dumps_taken != taken:
            taken = dumper.dumps_taken
            oracle[dumper.state_dict()["seq"]] = {"step": step, "rows": shards.take_touched()}
        if step == ckpt_step and ckpt_path is not None:
            hook.before_checkpoint()  # every dump so far committed; still the run's owner
            state = {
                "hook": hook.state_dict(),
                "weights": {t: w.cpu().clone() for t, w in shards.weights.items()},
                "step": step,
            }
            torch.save(state, ckpt_path)
    hook.on_end(last)
    oracle[dumper.state_dict()["seq"]] = {"step": last, "rows": shards.take_touched()}
    return oracle


def check_dumps(
    root: ArtifactRoot, run: str, gen: int, rank: int, oracle: dict[int, dict[str, Any]]
) -> list[str]:
    """Problems: this rank's rows of every committed dump vs the oracle ([] when all equal)."""
    problems = []
    committed = root.list_dumps(run, gen)
    if committed != sorted(oracle):
        problems.append(f"gen {gen}: committed dumps {committed}, taken {sorted(oracle)}")
    info = root.read_generation(run, gen)
    for seq in committed:
        if seq not in oracle:
            continue
        m = root.read_manifest(run, gen, seq)
        ddir = root.dump_dir(run, gen, seq)
        if m.world_size != dist_world():
            problems.append(f"gen {gen} dump {seq}: world_size {m.world_size}")
        for table, (keys, rows) in oracle[seq]["rows"].items():
            spec = info.tables[table]
            mine = [s for s in m.shards_of(table) if s.rank == rank]
            parts = [read_shard(root, ddir, s, spec.dtype) for s in mine]
            got_k = np.concatenate([p.keys for p in parts]) if parts else np.empty(0, np.int64)
            got_r = (
                codec.decode(np.concatenate([p.embedding for p in parts]), spec.dtype, spec.dim)
                if parts
                else np.empty((0, spec.dim), np.float32)
            )
            got_s = np.concatenate([p.steps for p in parts]) if parts else np.empty(0)
            order = np.argsort(got_k)
            where = f"gen {gen} dump {seq} ({m.kind.value}, step {m.last_step}) {table} rank {rank}"
            if not np.array_equal(got_k[order], keys):
                problems.append(f"{where}: {len(got_k)} keys dumped, {len(keys)} touched")
            elif not np.array_equal(got_r[order], rows):
                diff = float(np.abs(got_r[order] - rows).max())
                problems.append(f"{where}: rows differ from the table (max {diff})")
            if len(got_s) and not (got_s == oracle[seq]["step"]).all():
                problems.append(f"{where}: step column {sorted(set(got_s.tolist()))[:5]}")
    return problems


def phase_generations(a: argparse.Namespace, work: str, device: torch.device) -> dict[str, Any]:
    rank, world = dist_rank(), dist_world()
    art = f"{work}/art"
    root = ArtifactRoot(art)
    ckpt_path = f"{work}/ckpt-rank-{rank:05d}.pt"
    dense = torch.zeros(a.dense, device=device)
    steps = a.steps
    ckpt = steps // 2
    slow = (2, 4)  # after the 2nd and 4th delta
    shards = Shards(a.rows, rank, world, device, a.seed + 1)
    hook = make_hook(a, art, "gen", shards)
    hook.on_start(torch.nn.Module(), 0, None)
    dumper = hook.dumper
    assert dumper is not None
    exchanges = [
        {
            "name": x.name,
            "backend": dist.get_backend(x.group),
            "default": x.group is dist.group.WORLD,
        }
        for x in (dumper._train_x, dumper._worker_x)
        if x is not None and x.group is not None
    ]
    try:
        oracle1 = train_generation(a, shards, hook, 1, steps, dense, slow, ckpt, ckpt_path)
    finally:
        hook.close()
    problems = check_dumps(root, "gen", 1, rank, oracle1)
    gaps = np.diff([oracle1[s]["step"] for s in sorted(oracle1)[:-1]])  # snapshot..last delta
    by_step, by_time = int((gaps == a.every).sum()), int((gaps < a.every).sum())
    if by_step == 0 or by_time == 0:
        problems.append(f"gen 1: {by_step} step dumps and {by_time} time dumps (want both)")

    # generation 2, restored from the checkpoint of step ``ckpt``
    state = torch.load(ckpt_path, weights_only=False)
    for t, w in state["weights"].items():
        shards.weights[t].copy_(w.to(device))
    shards.take_touched()
    hook2 = make_hook(a, art, "gen", shards)
    hook2.load_state_dict(state["hook"])
    hook2.on_start(torch.nn.Module(), ckpt, ckpt)
    assert hook2.dumper is not None and hook2.dumper.generation is not None
    parent = hook2.dumper.generation.parent
    if parent is None or (parent.generation, parent.checkpoint_step) != (1, ckpt):
        problems.append(f"gen 2: parent {parent}, want generation 1 at step {ckpt}")
    after = [s for s, o in oracle1.items() if o["step"] > ckpt]
    want = {}
    for t, w in state["weights"].items():
        keys = np.unique(np.concatenate([oracle1[s]["rows"][t][0] for s in after]))
        want[t] = (keys, w.numpy()[keys - shards.offset])
    republished = sum(len(k) for k, _ in want.values())
    try:
        oracle2 = train_generation(a, shards, hook2, ckpt + 1, ckpt + a.steps2, dense)
    finally:
        hook2.close()
    oracle2[1] = {"step": ckpt, "rows": want}
    problems += check_dumps(root, "gen", 2, rank, oracle2)
    dump_steps = {
        f"gen{g}": sorted((s, o["step"]) for s, o in orc.items())
        for g, orc in ((1, oracle1), (2, oracle2))
    }
    return {
        "exchanges": exchanges,
        "gen1_dumps": len(oracle1),
        "gen1_step_dumps": by_step,
        "gen1_time_dumps": by_time,
        "gen1_rows_checked": sum(len(k) for o in oracle1.values() for k, _ in o["rows"].values()),
        "checkpoint_step": ckpt,
        "gen2_republished_keys": republished,
        "gen2_dumps": len(oracle2),
        "dump_steps": dump_steps,
        "problems": problems,
    }


# ---- phase 4: kill one rank --------------------------------------------------------------
def kill_child(spec: dict[str, Any]) -> None:
    """One rank of the kill run (a child of a torchrun rank): trains until stopped."""
    os.environ.update(spec["env"])
    out = Path(spec["out"])
    rank, world = int(spec["env"]["RANK"]), int(spec["env"]["WORLD_SIZE"])
    result: dict[str, Any] = {"rank": rank}
    hook = None
    try:
        a = argparse.Namespace(**spec["args"])
        device = torch.device(spec["device"])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            spec["backend"], timeout=datetime.timedelta(seconds=a.kill_pg_timeout)
        )
        shards = Shards(a.rows, rank, world, device, a.seed + 2)
        dense = torch.zeros(a.dense, device=device) if spec["dense"] else None
        a.every, a.minutes, a.pg_timeout = 5, None, a.kill_pg_timeout
        hook = make_hook(a, spec["art"], "kill", shards, snapshot=False)
        hook.on_start(torch.nn.Module(), 0, None)
        dumper = hook.dumper
        assert dumper is not None
        victim = rank == world - 1
        faults = f"{spec['work']}/faults"
        deadline = time.time() + a.kill_bound
        for step in range(1, 10**7):
            shards.step(a.batch, dense)
            hook.after_step(step)
            if step == 5:
                dumper.wait_idle()  # dump 1 committed on every rank
                if victim:  # hold this rank's worker in the middle of dump 2's shard write
                    os.environ["DELTAREC_FAULT"] = "shard.write"
                    os.environ["DELTAREC_FAULT_DIR"] = faults
            if victim and dumper.state_dict()["seq"] == 2:
                held = Path(faults) / f"shard.write.{os.getpid()}"
                while not held.exists():
                    if time.time() > deadline:
                        raise TimeoutError("the worker never reached its shard write")
                    time.sleep(0.005)
                (out.parent / "killed_at").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            if time.time() > deadline:
                raise TimeoutError(f"still training at step {step}, {a.kill_bound} s on")
    except BaseException as e:
        result["stopped_at"] = time.time()
        result["error"] = f"{type(e).__name__}: {e}"[:1500]
        result["traceback_tail"] = traceback.format_exc()[-1500:]
    try:
        worker = hook.dumper._worker if hook is not None and hook.dumper is not None else None
        for _ in range(200):  # what deltarec's own worker saw (it may still be failing)
            if worker is None or worker.failure is not None:
                break
            time.sleep(0.05)
        failure = worker.failure if worker is not None else None
        result["deltarec_worker_failure"] = None if failure is None else str(failure)[:1500]
        t0 = time.time()
        if hook is not None:
            hook.close()
        result["close_s"] = time.time() - t0
    except BaseException as e:
        result["close_error"] = f"{type(e).__name__}: {e}"[:500]
    out.write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no teardown of a process group whose peer is dead


def phase_kill(
    a: argparse.Namespace, work: str, device: torch.device, dense: bool
) -> dict[str, Any]:
    """The kill run: with ``dense``, every step all-reduces on the default group too."""
    rank, world = dist_rank(), dist_world()
    box = [free_port() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    kdir = Path(work)
    kdir.mkdir(parents=True, exist_ok=True)
    env = {
        "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
        "MASTER_PORT": str(box[0]),
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": os.environ.get("LOCAL_RANK", "0"),
        "TORCHELASTIC_USE_AGENT_STORE": "False",  # the child's rank 0 hosts its own store
    }
    spec: dict[str, Any] = {
        "env": env,
        "out": str(kdir / f"rank-{rank}.json"),
        "art": f"{work}/art",
        "work": str(kdir),
        "device": str(device),
        "backend": dist.get_backend(),
        "args": vars(a),
        "dense": dense,
    }
    ctx = mp.get_context("spawn")
    with open(kdir / f"rank-{rank}.log", "w") as log:
        p = ctx.Process(target=kill_child, args=(spec,), name=f"kill-rank-{rank}")
        old = os.dup(2)
        os.dup2(log.fileno(), 2)  # the child's stderr (an NCCL watchdog's message) to the log
        try:
            p.start()
        finally:
            os.dup2(old, 2)
            os.close(old)
        p.join(a.kill_bound + 60)
        hung = p.is_alive()
        if hung:
            p.kill()
            p.join()
    res: dict[str, Any] = {"exitcode": p.exitcode, "hung": hung, "victim": rank == world - 1}
    res["dense"] = dense
    path = Path(spec["out"])
    if path.exists():
        res.update(json.loads(path.read_text()))
    killed_at = kdir / "killed_at"
    dist.barrier()  # every child has ended: killed_at is there (or never will be)
    if killed_at.exists() and "stopped_at" in res:
        res["seconds_after_kill"] = res.pop("stopped_at") - float(killed_at.read_text())
    if not res["victim"] and "error" not in res:
        tail = (kdir / f"rank-{rank}.log").read_text()[-1500:]
        res["log_tail"] = tail
    return res


def kill_problems(results: list[dict[str, Any]], bound: float) -> list[str]:
    problems = []
    for r in results:
        if r["victim"]:
            if r["exitcode"] != -signal.SIGKILL or r["hung"] or "error" in r:
                problems.append(f"victim rank {r.get('rank')}: not killed as planned: {r}")
            continue
        who = f"rank {r.get('rank')}"
        if r["hung"]:
            problems.append(f"{who}: still running {bound + 60:.0f} s after the start (hang)")
        elif "error" not in r:
            watchdog = "Watchdog" in r.get("log_tail", "") or "timeout" in r.get("log_tail", "")
            if not watchdog:
                problems.append(f"{who}: ended (exit {r['exitcode']}) without an error")
        elif r["error"].startswith("TimeoutError"):
            problems.append(f"{who}: never stopped: {r['error']}")
        elif not r["dense"] and not r["error"].startswith(("DumpError", "RankLostError")):
            problems.append(f"{who}: stopped by {r['error'][:200]}, not by deltarec")
        if "close_error" in r:
            problems.append(f"{who}: closing the hook failed: {r['close_error']}")
    return problems


# ---- main --------------------------------------------------------------------------------
def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4_000_000, help="rows per table, all ranks")
    p.add_argument("--batch", type=int, default=16384, help="lookups per table, rank, step")
    p.add_argument("--dense", type=int, default=1_000_000, help="dense gradient all-reduced")
    p.add_argument("--every", type=int, default=50, help="dump every N steps")
    p.add_argument("--minutes", type=float, default=0.02, help="dump every M minutes")
    p.add_argument("--steps", type=int, default=300, help="steps of generation 1")
    p.add_argument("--steps2", type=int, default=120, help="steps of generation 2")
    p.add_argument("--timing-steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pg-timeout", type=float, default=300.0, help="default group timeout, s")
    p.add_argument("--kill-pg-timeout", type=float, default=60.0, help="kill run's timeout, s")
    p.add_argument("--kill-bound", type=float, default=120.0, help="most seconds to stop, s")
    p.add_argument("--device-id", action="store_true", help="bind the group to the GPU")
    p.add_argument("--skip", default="", help="comma-separated phases to skip")
    p.add_argument("--dir", default=None, help="work directory's parent (default: tmp)")
    p.add_argument("--json", default=None, help="also write the summary here (rank 0)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    return p.parse_args()


def main() -> int:
    a = parse()
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(device)
    if "RANK" in os.environ:
        dist.init_process_group(
            backend,
            timeout=datetime.timedelta(seconds=a.pg_timeout),
            device_id=device if cuda and a.device_id else None,
        )
    rank, world = dist_rank(), dist_world()
    box = [tempfile.mkdtemp(prefix="deltarec-multigpu-", dir=a.dir) if rank == 0 else None]
    if world > 1:
        dist.broadcast_object_list(box, src=0)
    work = str(box[0])
    skip = set(filter(None, a.skip.split(",")))
    mine: dict[str, Any] = {}
    for name, phase in (("timing", phase_timing), ("generations", phase_generations)):
        if name in skip:
            continue
        try:
            mine[name] = phase(a, f"{work}/{name}", device)
        except Exception as e:
            mine[name] = {"problems": [f"{name} failed: {type(e).__name__}: {e}"]}
            traceback.print_exc()
    for name, dense in (("kill", True), ("kill_alone", False)):
        if world > 1 and name not in skip:
            mine[name] = phase_kill(a, f"{work}/{name}", device, dense)
    everyone: list[Any] = [mine]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    summary = summarize(a, everyone, device) | {"work": work}
    if rank == 0:
        text = json.dumps(summary, indent=1, default=str)
        print(text)
        if a.json:
            Path(a.json).write_text(text)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0 and not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if summary["ok"] else 1


def summarize(a: argparse.Namespace, everyone: list[dict[str, Any]], device: torch.device) -> Any:
    world = len(everyone)
    problems: list[str] = []
    out: dict[str, Any] = {
        "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        "machine": f"{platform.node()} ({os.cpu_count()} cores)"
        + (f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""),
        "torch": torch.__version__,
        "ranks": world,
        "backend": "nccl" if device.type == "cuda" else "gloo",
        "device": device.type,
        "workload": f"2 tables x {a.rows} rows (64, 32 wide) row-sharded, {a.batch} lookups "
        f"per table/rank/step, dense all-reduce {a.dense} floats, dump every {a.every} steps "
        f"or {a.minutes} min",
    }
    for r, res in enumerate(everyone):
        for phase in ("timing", "generations"):
            problems += [f"rank {r}: {p}" for p in res.get(phase, {}).get("problems", [])]
    if all("timing" in res and "steps" in res["timing"] for res in everyone):
        out["timing"] = [res["timing"] for res in everyone]
    gens = [res.get("generations", {}) for res in everyone]
    if all("dump_steps" in g for g in gens):
        if any(g["dump_steps"] != gens[0]["dump_steps"] for g in gens):
            problems.append("ranks dumped at different steps")
        out["generations"] = {k: v for k, v in gens[0].items() if k != "problems"}
        out["generations"]["rows_checked_per_rank"] = [g["gen1_rows_checked"] for g in gens]
    for name in ("kill", "kill_alone"):
        if all(name in res for res in everyone) and world > 1:
            kills = [res[name] for res in everyone]
            out[name] = kills
            problems += [f"{name}: {p}" for p in kill_problems(kills, a.kill_bound)]
        elif world == 1:
            out[name] = "skipped: one rank"
    out["problems"] = problems
    out["ok"] = not problems
    return out


if __name__ == "__main__":
    sys.exit(main())
