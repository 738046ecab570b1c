"""The dumper on the sharded example model, 2 CPU ranks (gloo), through ``run_training``.

Every sharding type of the example model is dumped (table-wise, row-wise, column-wise,
table-row-wise, data-parallel, the EmbeddingCollection and the ZCH table). Each spawned run
checks several behaviours; the model's rows are read independently through
``deltarec.train.table_rows`` (a gather of ``dmp.state_dict()``) at every dump step.
"""

from __future__ import annotations

import numpy as np
import pytest
from tests._helpers.dump import read_dump

from deltarec.testing.multiprocess import run_on_ranks

pytestmark = pytest.mark.multiprocess

EVERY = 3
STEPS = 12
CKPT = 6
BATCH = 16


class _Oracle:
    """A hook after the dump hook: at each dump step, read every table from the state dict."""

    def __init__(self, sm, dump_hook, config) -> None:
        self.sm = sm
        self.dump_hook = dump_hook
        self.config = config
        self.at_dump: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
        self.touched: dict[int, dict[str, set[int]]] = {}
        self._since: dict[str, set[int]] = {}
        self._start = 0

    def on_start(self, model, step, restored_from) -> None:
        self._start = step
        self._read(step)

    def _read(self, step: int) -> None:
        from deltarec.train import table_rows

        state = self.sm.dmp.state_dict()
        got = {}
        for t in self.sm.tables:
            rows = table_rows(self.sm, t, state)
            if rows is not None:  # copies: a data-parallel table's rows alias the live weight
                got[t.table_id] = (rows[0].copy(), rows[1].copy())
        self.at_dump[step] = got

    def _record_batch(self, step: int) -> None:
        from deltarec.model.data import ClickStream

        for rank in range(self.sm.world_size):
            cfg = self.config
            stream = ClickStream(cfg.model, cfg.data, cfg.batch_size, cfg.seed, rank)
            b = stream.batch(step - 1)
            for name in cfg.model.tables:
                ids = b.bags[name].values().tolist()
                self._since.setdefault(f"sparse.ebc.{name}", set()).update(ids)
            ids = b.history["history"].values().tolist()
            self._since.setdefault("sparse.ec.history", set()).update(ids)

    def after_step(self, step: int) -> None:
        self._record_batch(step)
        if self.dump_hook.dumper._last_dump_step == step:
            self.touched[step] = self._since
            self._since = {}
            self._read(step)

    def before_eval(self) -> None:
        pass

    def after_eval(self) -> None:
        pass

    def on_end(self, step: int) -> None:
        self._read(step)

    def close(self) -> None:
        pass

    def before_checkpoint(self) -> None:
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, state) -> None:
        pass


def _train(
    workdir: str, artifacts: str, steps: int, resume_step: int | None, run: str = "demo", **options
):
    from deltarec.dump import make_train_hook
    from deltarec.model.sharding import build_sharded_model
    from deltarec.train import TrainConfig, run_training

    config = TrainConfig(
        steps=steps,
        batch_size=BATCH,
        workdir=workdir,
        checkpoint_every=CKPT,
        resume=resume_step is not None,
        resume_step=resume_step,
        eval_every=4,
        eval_batches=1,
        log_every=1000,
    )
    sm = build_sharded_model(config.model, config_device(), seed=0, max_batch_size=BATCH)
    hook = make_train_hook(
        artifacts=artifacts, run=run, every_steps=EVERY, chunk_rows=97, **options
    )
    oracle = _Oracle(sm, hook, config)
    run_training(config, hooks=[hook, oracle], model=sm)
    return hook, oracle


def config_device():
    import torch

    return torch.device("cpu")


def _ranks_train_and_uneven(rank: int, world_size: int, tmp: str) -> dict:
    from deltarec.dump import DataMismatchError, Dumper, DumperConfig

    _, oracle = _train(f"{tmp}/work", f"{tmp}/art", STEPS, None)
    # uneven data exhaustion seen by the final dump: rank 1 stopped two steps early
    d = Dumper(DumperConfig(artifacts=f"{tmp}/art", run="uneven", snapshot=False), [])
    d.start(step=0)
    uneven = None
    try:
        d.final_dump(5 if rank == 0 else 3)
    except DataMismatchError as e:
        uneven = str(e)
    finally:
        d.close()
    out: dict = {
        "uneven": uneven,
        "time_dumps": _time_cadence(rank, tmp),
        "failure": _one_rank_fails(rank, tmp),
    }
    if rank == 0:
        out["oracle"] = (oracle.at_dump, oracle.touched)
    return out


def _time_cadence(rank: int, tmp: str) -> list[int]:
    """Dump every 0.25 s on ranks whose steps take different times: same dump steps?"""
    import time

    from tests._helpers.dump import HandTables

    from deltarec.dump import Dumper, DumperConfig

    tables = HandTables(seed=rank)
    tables.offsets = {t: o + 10_000 * rank for t, o in tables.offsets.items()}
    cfg = DumperConfig(
        artifacts=f"{tmp}/art", run="clock", every_minutes=0.25 / 60, snapshot=False, fsync=False
    )
    d = Dumper(cfg, tables.sources())
    d.start(step=0)
    steps = []
    for step in range(1, 120):
        tables.step(step, n=2)
        time.sleep(0.004 * (1 + rank))
        if d.maybe_dump(step) is not None:
            steps.append(step)
    d.final_dump(119)
    d.close()
    return steps


def _one_rank_fails(rank: int, tmp: str) -> str | None:
    """Rank 1 cannot write a shard: the dump fails on both ranks, naming rank and table."""
    from tests._helpers.dump import HandTables

    from deltarec.dump import Dumper, DumperConfig
    from deltarec.dump.encode import ParallelShardWriter
    from deltarec.errors import DumpError

    tables = HandTables(seed=rank)
    tables.offsets = {t: o + 10_000 * rank for t, o in tables.offsets.items()}
    cfg = DumperConfig(artifacts=f"{tmp}/art", run="fail", snapshot=False, fsync=False)
    d = Dumper(cfg, tables.sources())
    d.start(step=0)
    if rank == 1:
        real = ParallelShardWriter._append

        def failing(self, data):
            if self.table == "sparse.b" and self.size > 0:  # the first chunk's bytes
                raise OSError("No space left on device")
            real(self, data)

        ParallelShardWriter._append = failing  # type: ignore[method-assign]
    tables.step(1)
    d.dump_now(1)
    try:
        d.wait_idle(timeout=60)
    except DumpError as e:
        return str(e)
    finally:
        d.close()
    return None


def _ranks_restore(rank: int, world_size: int, tmp: str) -> dict:
    _, oracle1 = _train(f"{tmp}/work", f"{tmp}/art", CKPT + EVERY, None)
    # restart from the checkpoint at step CKPT: generation 2, parent {1, CKPT}
    _, oracle2 = _train(f"{tmp}/work", f"{tmp}/art", CKPT + EVERY, CKPT)
    return {"oracle1": oracle1.at_dump, "oracle2": oracle2.at_dump} if rank == 0 else {}


def test_every_dump_on_two_ranks_holds_the_touched_rows_at_that_step(tmp_path):
    from deltarec.artifacts import ArtifactRoot

    results = run_on_ranks(_ranks_train_and_uneven, 2, args=(str(tmp_path),), timeout_s=240)
    # uneven exhaustion fails on every rank, naming the ranks and steps
    for r in results:
        assert r["uneven"] is not None and "rank 0: step 5, rank 1: step 3" in r["uneven"]
    # one rank's write failure fails the dump on every rank, naming rank and table
    for r in results:
        assert r["failure"] is not None
        assert "dump 1" in r["failure"] and "sparse.b" in r["failure"]
        assert "rank 1" in r["failure"] and "No space left" in r["failure"]
    fail_root = ArtifactRoot(str(tmp_path / "art"))
    assert fail_root.list_dumps("fail", 1) == [] and fail_root.list_incomplete_dumps("fail", 1)
    # a time cadence dumps at the same steps on every rank, without a per-step collective
    assert results[0]["time_dumps"] == results[1]["time_dumps"]
    assert 1 <= len(results[0]["time_dumps"]) <= 6, results[0]["time_dumps"]

    root = ArtifactRoot(str(tmp_path / "art"))
    at_dump, touched = results[0]["oracle"]
    info = root.read_generation("demo", 1)
    assert set(info.tables) >= {f"sparse.ebc.{t}" for t in ("user_id", "item_id", "category")}
    shardings = {t: s.sharding for t, s in info.tables.items()}
    assert set(shardings.values()) >= {
        "table_wise",
        "row_wise",
        "column_wise",
        "table_row_wise",
        "data_parallel",
    }
    _check_dumps(root, "demo", at_dump, touched)


def _check_dumps(root, run: str, at_dump: dict, touched: dict) -> None:
    """Every dump of ``run`` holds the rows touched since the last, at its step, once each;
    replaying them gives the final tables."""
    from deltarec.artifacts import check_shard
    from deltarec.artifacts.lineage import expected_state

    info = root.read_generation(run, 1)
    dumps = root.list_dumps(run, 1)
    assert dumps == list(range(STEPS // EVERY + 2))  # snapshot, 4 deltas, final
    for seq in dumps:
        m = root.read_manifest(run, 1, seq)
        for s in m.shards:
            check_shard(root, root.dump_dir(run, 1, seq), s)
        got = read_dump(root, run, 1, seq)
        state = at_dump[m.last_step]
        for table, (keys, rows, _ops, steps) in got.items():
            assert len(np.unique(keys)) == len(keys), (seq, table)
            assert (steps == m.last_step).all()
            assert m.tables[table] == len(keys)
            if info.tables[table].kind.value == "zch":
                continue
            order = np.argsort(keys)
            keys, rows = keys[order], rows[order]
            all_keys, all_rows = state[table]
            if m.kind.value == "snapshot":
                assert np.array_equal(keys, all_keys), table
            elif m.kind.value == "delta":
                want = np.array(sorted(touched[m.last_step].get(table, ())), dtype=np.int64)
                assert np.array_equal(keys, want), (seq, table)
            assert np.array_equal(rows, all_rows[keys]), (seq, table)
    # replaying every dump reproduces the final tables (the export) for every key
    final = at_dump[STEPS]
    replay = expected_state(root, run, 1)
    for table, (keys, rows) in final.items():
        et = replay.tables[table]
        live = et.keys[et.ops == 0]
        assert np.array_equal(np.sort(live), np.sort(keys)), table
        decoded = et.load(keys)
        assert np.array_equal(decoded, rows), table


def _ranks_spread(rank: int, world_size: int, tmp: str) -> dict:
    hook, oracle = _train(f"{tmp}/work", f"{tmp}/art", STEPS, None, run="spread", spread_steps=2)
    spread = hook.dumper.spread.opened if hook.dumper is not None else 0
    return {"oracle": (oracle.at_dump, oracle.touched), "spread": spread}


def test_spread_dumps_on_two_ranks_hold_the_touched_rows_at_their_step(tmp_path):
    """torchrec's tracker seen as it records: every delta read over the steps after it."""
    from deltarec.artifacts import ArtifactRoot

    results = run_on_ranks(_ranks_spread, 2, args=(str(tmp_path),), timeout_s=240)
    assert all(r["spread"] >= STEPS // EVERY - 1 for r in results), results
    at_dump, touched = results[0]["oracle"]
    _check_dumps(ArtifactRoot(str(tmp_path / "art")), "spread", at_dump, touched)


def test_a_restore_on_two_ranks_republishes_the_keys_published_after_the_checkpoint(tmp_path):
    from deltarec.artifacts import ArtifactRoot, Parent
    from deltarec.artifacts.lineage import keys_published_after

    results = run_on_ranks(_ranks_restore, 2, args=(str(tmp_path),), timeout_s=240)
    root = ArtifactRoot(str(tmp_path / "art"))
    at_dump = results[0]["oracle1"]
    # restore: generation 2 republishes exactly the keys published after step CKPT,
    # with the values the model had at the checkpoint
    info2 = root.read_generation("demo", 2)
    assert info2.parent == Parent(1, CKPT)
    want = keys_published_after(root, "demo", Parent(1, CKPT))
    restored = results[0]["oracle2"][CKPT]
    assert np.array_equal(restored["sparse.ebc.item_id"][1], at_dump[CKPT]["sparse.ebc.item_id"][1])
    m = root.read_manifest("demo", 2, 1)
    assert (m.first_step, m.last_step) == (CKPT, CKPT)
    got = read_dump(root, "demo", 2, 1)
    for table, (keys, rows, _, _) in got.items():
        order = np.argsort(keys)
        assert np.array_equal(keys[order], want.get(table, np.empty(0, np.int64))), table
        if info2.tables[table].kind.value == "zch":
            continue
        assert np.array_equal(rows[order], restored[table][1][keys[order]]), table
    assert root.list_dumps("demo", 2) == [1, 2, 3]  # republish, delta at step 9, final
    assert all(len(k) for k in want.values())
