"""The dumper beside a training group that is not gloo (the NCCL shape), on 2 CPU ranks.

A real job's default process group is NCCL; deltarec's collectives must run on gloo side
groups of its own. Here the default group is ``recording``: a backend registered by this
module that runs every collective through gloo and records it (operation, thread), so the
ranks train on it like on NCCL and the test sees whether anything of deltarec touched it.
The tables are plain tensors row-sharded by hand (``HandTables``, each rank its row block).

A rank killed with SIGKILL (mid-dump, or between dumps while the time cadence agrees on the
clock) must make the other rank stop with an error naming what failed, without waiting for
the dead rank: ``spawn_ranks`` kills a rank still running ``GRACE_S`` after the other died.
The killed run's training step has no collective of its own: on gloo it would fail first,
on NCCL it hangs on the device, so deltarec's groups must notice the dead rank by themselves.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from tests._helpers.dump import HandTables, read_dump

from deltarec.testing.multiprocess import RemoteRankError, run_on_ranks, spawn_ranks

BACKEND = "recording"
GRACE_S = 60.0
EVERY = 4
STEPS = 14
CKPT = 8
SLOW = 9
CALLS: list[tuple[str, str]] = []
"""(operation, thread name) of every collective run on the default (``recording``) group."""


def _recorded(op: str):
    """The collective ``op`` of the gloo group underneath, recorded in :data:`CALLS` first."""

    def collective(self, *args):
        CALLS.append((op, threading.current_thread().name))
        return getattr(self.inner, op)(*args)

    return collective


class _RecordingGroup(dist.ProcessGroup):
    """A default process group that is not gloo: gloo underneath, every collective recorded."""

    def __init__(self, inner: dist.ProcessGroup, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self.inner = inner

    allreduce = _recorded("allreduce")
    allgather = _recorded("allgather")
    broadcast = _recorded("broadcast")
    gather = _recorded("gather")
    barrier = _recorded("barrier")

    def getBackendName(self) -> str:
        return BACKEND


def _create_recording(store, rank, size, timeout):
    return _RecordingGroup(dist.ProcessGroupGloo(store, rank, size, timeout), rank, size)


if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND, _create_recording, devices=["cpu"])


def _tables(rank: int) -> HandTables:
    """This rank's row blocks: rank r holds global rows [10000 r, 10000 r + rows)."""
    tables = HandTables(seed=rank)
    tables.offsets = {t: o + 10_000 * rank for t, o in tables.offsets.items()}
    return tables


def _train_restore_and_check(rank: int, world_size: int, tmp: str) -> dict:
    """Generation 1 with step and time cadence, a checkpoint, generation 2 from it."""
    from deltarec.dump import Dumper, DumperConfig

    assert dist.get_backend() == BACKEND
    tables = _tables(rank)
    cfg = DumperConfig(
        artifacts=f"{tmp}/art",
        run="side",
        every_steps=EVERY,
        every_minutes=1.0 / 60,
        fsync=False,
        chunk_rows=37,
    )
    d = Dumper(cfg, tables.sources())
    d.start(step=0)
    exchanges = [
        (str(dist.get_backend(x.group)), x.group is dist.group.WORLD)
        for x in (d._train_x, d._worker_x)
        if x is not None and x.group is not None
    ]
    want: dict[int, dict] = {0: _rows(tables, all_rows=True)}
    dumps: list[tuple[int, int]] = []
    ckpt = None
    grad = torch.ones(16)
    for step in range(1, STEPS + 1):
        tables.step(step)
        dist.all_reduce(grad)  # the training's own collective, on the default group
        if step == SLOW:  # past the 1 s deadline: the agreement right after a step dump says so
            time.sleep(1.2)
        seq = d.maybe_dump(step)
        if seq is not None:
            dumps.append((seq, step))
            want[seq] = _rows(tables)
        if step == CKPT:  # as before a training checkpoint: dumps committed, still the owner
            d.wait_idle()
            d.check_owner()
            ckpt = (d.state_dict(), {t: w.clone() for t, w in tables.weights.items()})
    final = d.final_dump(STEPS)
    want[final.seq] = _rows(tables)
    d.close()
    assert ckpt is not None
    # generation 2 from the checkpoint of step CKPT: republish, then train on
    state, weights = ckpt
    for t, w in weights.items():
        tables.weights[t].copy_(w)
    tables.take_touched()
    d2 = Dumper(cfg.model_copy(update={"every_minutes": None}), tables.sources())
    d2.load_state_dict(state)
    gen2 = d2.start(step=CKPT)
    republished = {t: tables.weights[t].clone() for t in tables.weights}
    for step in range(CKPT + 1, CKPT + 4):
        tables.step(step)
        dist.all_reduce(grad)
    final2 = d2.final_dump(CKPT + 3)
    after = _rows(tables)
    d2.close()
    return {
        "calls": list(CALLS),
        "exchanges": exchanges,
        "dumps": dumps,
        "final": final.seq,
        "want": want,
        "gen2": gen2.generation,
        "parent": (gen2.parent.generation, gen2.parent.checkpoint_step) if gen2.parent else None,
        "republished": {t: (w.numpy(), tables.offsets[t]) for t, w in republished.items()},
        "final2": (final2.seq, after),
        "steps": STEPS + 3,
    }


def _rows(tables: HandTables, all_rows: bool = False) -> dict[str, tuple]:
    """``{table: (sorted keys, rows)}``: touched since the last call (or every row)."""
    touched = tables.take_touched()
    out = {}
    for t, w in tables.weights.items():
        if all_rows:
            keys = np.arange(w.shape[0], dtype=np.int64) + tables.offsets[t]
        else:
            keys = np.array(sorted(touched[t]), dtype=np.int64)
        out[t] = (keys, tables.rows_of(t, keys) if len(keys) else np.empty((0, w.shape[1])))
    return out


def _dumped(root, gen: int, seq: int, rank: int) -> dict[str, tuple]:
    """One rank's rows of a committed dump: ``{table: (sorted keys, rows, steps)}``."""
    out = {}
    for table, (keys, rows, _, steps) in read_dump(root, "side", gen, seq).items():
        mine = (keys >= 10_000 * rank) & (keys < 10_000 * (rank + 1))
        order = np.argsort(keys[mine])
        out[table] = (keys[mine][order], rows[mine][order], steps[mine][order])
    return out


@pytest.mark.multiprocess
def test_beside_a_non_gloo_training_group_every_dump_and_the_republish_hold_the_model_rows(
    tmp_path,
):
    from deltarec.artifacts import ArtifactRoot

    results = run_on_ranks(
        _train_restore_and_check, 2, args=(str(tmp_path),), backend=BACKEND, timeout_s=240
    )
    root = ArtifactRoot(str(tmp_path / "art"))
    for rank, r in enumerate(results):
        # deltarec ran nothing on the default group: only the training's own all_reduces
        assert r["calls"] == [("allreduce", "MainThread")] * r["steps"]
        assert r["exchanges"] == [("gloo", False), ("gloo", False)]
        # both cadences fired: a step dump (every EVERY) and a time dump in between
        gaps = np.diff([0] + [s for _, s in r["dumps"]])
        assert (gaps == EVERY).any() and (gaps < EVERY).any(), r["dumps"]
        assert r["dumps"] == results[0]["dumps"]
        for seq, want in r["want"].items():
            got = _dumped(root, 1, seq, rank)
            step = dict(r["dumps"]).get(seq, 0 if seq == 0 else STEPS)
            for table, (keys, rows) in want.items():
                assert np.array_equal(got[table][0], keys), (rank, seq, table)
                assert np.array_equal(got[table][1], rows), (rank, seq, table)
                assert (got[table][2] == step).all(), (rank, seq, table)
        # generation 2 republished every key generation 1 dumped after step CKPT, restored
        assert r["gen2"] == 2 and r["parent"] == (1, CKPT)
        republish = _dumped(root, 2, 1, rank)
        for table, (weights, offset) in r["republished"].items():
            after = [s for s, step in r["dumps"] if step > CKPT] + [r["final"]]
            keys = np.unique(np.concatenate([r["want"][s][table][0] for s in after]))
            assert np.array_equal(republish[table][0], keys), (rank, table)
            assert np.array_equal(republish[table][1], weights[keys - offset]), (rank, table)
        seq2, want2 = r["final2"]
        got2 = _dumped(root, 2, seq2, rank)
        for table, (keys, rows) in want2.items():
            assert np.array_equal(got2[table][0], keys) and np.array_equal(got2[table][1], rows)


def _killed(rank: int, world_size: int, tmp: str, where: str) -> dict:
    """Rank 1 dies by SIGKILL; rank 0 trains on until deltarec stops it."""
    from deltarec import faults
    from deltarec.artifacts import ArtifactRoot
    from deltarec.dump import Dumper, DumperConfig
    from deltarec.errors import DeltarecError

    tables = _tables(rank)
    cfg = DumperConfig(
        artifacts=f"{tmp}/art",
        run=f"kill-{where}",
        every_steps=3 if where == "mid_dump" else None,
        every_minutes=0.02 / 60 if where == "between_dumps" else None,
        snapshot=False,
        fsync=False,
    )
    d = Dumper(cfg, tables.sources())
    d.start(step=0)
    out: dict = {"error": None}
    try:
        for step in range(1, 100_000):
            tables.step(step)
            time.sleep(0.002)
            seq = d.maybe_dump(step)
            if step == 5:
                d.wait_idle()  # both ranks: what was dumped is committed, nothing in flight
                if rank == 1 and where == "between_dumps":
                    os.kill(os.getpid(), signal.SIGKILL)
                if rank == 1 and where == "mid_dump":  # hold dump 2 mid shard write
                    os.environ[faults.ENV] = "shard.write"
                    os.environ[faults.DIR_ENV] = f"{tmp}/fault"
            if rank == 1 and where == "mid_dump" and seq == 2:
                _wait_for_file(f"{tmp}/fault", f"shard.write.{os.getpid()}")
                os.kill(os.getpid(), signal.SIGKILL)  # dump 2 half written, not committed
    except DeltarecError as e:
        out["error"] = (type(e).__name__, str(e))
    finally:
        d.close(timeout=30)
    out["committed"] = ArtifactRoot(f"{tmp}/art").list_dumps(cfg.run, 1)
    return out


def _wait_for_file(folder: str, name: str) -> None:
    for _ in range(3000):
        if os.path.exists(os.path.join(folder, name)):
            return
        time.sleep(0.01)
    raise AssertionError(f"the worker never reached {name}")


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("where", "error", "what"),
    [
        ("mid_dump", "DumpError", "run 'kill-mid_dump' generation 1 dump 2: RankLostError"),
        ("between_dumps", "RankLostError", "the time cadence's clock agreement at step"),
    ],
)
def test_a_rank_killed_with_sigkill_stops_the_other_with_an_error_naming_what_failed(
    tmp_path, where, error, what
):
    outcomes = spawn_ranks(
        _killed, 2, args=(str(tmp_path), where), backend=BACKEND, grace_s=GRACE_S
    )
    dead, alive = outcomes[1], outcomes[0]
    assert isinstance(dead.error, RemoteRankError) and "without a result" in str(dead.error)
    assert alive.ok, alive.traceback or alive.error  # stopped and closed within GRACE_S
    name, message = alive.value["error"]
    assert name == error and what in message, message
    assert "rank 0 of 2" in message and "another rank's process ended" in message
    if where == "mid_dump":  # dump 1 committed; dump 2 lost with rank 1, never committed
        assert alive.value["committed"] == [1]


def test_waiting_for_the_dumps_before_any_dump_without_a_snapshot_returns_at_once(tmp_path):
    from deltarec.dump import Dumper, DumperConfig

    tables = HandTables()
    cfg = DumperConfig(artifacts=str(tmp_path), run="idle", snapshot=False, every_steps=5)
    d = Dumper(cfg, tables.sources())
    d.start(step=0)
    try:
        d.wait_idle(timeout=30)  # no dump 0 was queued: nothing to wait for
        tables.step(1)
        seq = d.dump_now(1)
        d.wait_idle(timeout=30)
        assert seq == 1 and d._worker is not None and d._worker.last_committed_seq() == 1
    finally:
        d.close()
