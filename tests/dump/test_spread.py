"""Spread dumps: a dump's rows read over the steps after it, copy on write (``spread_steps``).

The training loops here change exactly the rows they look up, after recording the lookup (as
a forward records before the backward's update); every committed dump must hold each touched
row once, with its value at the dump step, whatever the steps after it did to the row. Run on
CPU (the same path, eagerly) and on CUDA where there is one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests._helpers.dump import read_dump

from deltarec.artifacts import ArtifactRoot, TableKind, TableSpec
from deltarec.artifacts.lineage import expected_state
from deltarec.dump import Dumper, DumperConfig
from deltarec.dump.metrics import DumpCollector
from deltarec.tracking import spread
from deltarec.tracking.gather import HostRows
from deltarec.tracking.plain import RowShardSource
from deltarec.tracking.tracker import ManualTracker, TrackerHub

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]

ROWS = {"a": 3000, "b": 1200, "c": 700}
OFFSETS = {"a": 0, "b": 5000, "c": 9000}


@pytest.fixture(autouse=True)
def _small_ranges(monkeypatch):
    """Ranges and step shares small enough that a dump of these tables takes several steps."""
    monkeypatch.setattr(spread, "RANGE_ROWS", 64)
    monkeypatch.setattr(spread, "MIN_STEP_ROWS", 32)
    monkeypatch.setattr(spread, "MAX_STEP_ROWS", 200)
    monkeypatch.setattr(spread, "FINISH_READ_ROWS", 100)


class Loop:
    """Three tables on one device, a tracker fed before each step's update, and a dumper."""

    def __init__(self, tmp_path, device: str, run: str = "s", **options) -> None:
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(1)
        self.tables = {n: torch.randn(r, 8, generator=gen).to(self.device) for n, r in ROWS.items()}
        self.tracker = ManualTracker()
        self.hub = TrackerHub(self.tracker, set(ROWS))
        self.sources = [
            RowShardSource(
                f"m.{n}",
                TableSpec(dim=8, kind=TableKind.PLAIN, num_embeddings=OFFSETS[n] + r),
                self.hub,
                n,
                self.tables[n],
                OFFSETS[n],
            )
            for n, r in ROWS.items()
        ]
        cfg = dict(artifacts=str(tmp_path), run=run, chunk_rows=100, device_graph_bytes=0)
        cfg.update(options)
        self.dumper = Dumper(DumperConfig(**cfg), self.sources)
        self.gen = torch.Generator().manual_seed(2)
        self.touched: dict[str, set[int]] = {n: set() for n in ROWS}
        self.want: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
        self.root = ArtifactRoot(str(tmp_path))
        self.run = run

    def lookup(self, name: str, n: int, hot: int | None = None) -> torch.Tensor:
        high = hot or ROWS[name]
        ids = torch.randint(0, high, (n,), generator=self.gen).to(self.device)
        self.tracker.record(name, ids)
        return ids

    def step(self, step: int, n: int = 200, twice: bool = False, train: bool = True) -> None:
        """One step: record each table's lookups, then change exactly those rows."""
        for name, w in self.tables.items():
            looked = [self.lookup(name, n)]
            if twice:  # a second feature reading the same table in the same step
                looked.append(self.lookup(name, n // 2, hot=50))
            for ids in looked:
                if train:
                    self.touched[name].update(ids.tolist())
                    w.index_add_(0, ids, torch.full((ids.numel(), 8), 0.25, device=self.device))
        if train and self.dumper.maybe_dump(step) is not None:
            self.remember(step)

    def remember(self, step: int) -> None:
        """The rows the dump at ``step`` must hold: every touched row's value now."""
        self.want[step] = {}
        for name, w in self.tables.items():
            local = np.array(sorted(self.touched[name]), dtype=np.int64)
            rows = w[torch.from_numpy(local).to(self.device)].cpu().numpy()
            self.want[step][f"m.{name}"] = (local + OFFSETS[name], rows)
            self.touched[name] = set()

    def check(self, seqs) -> None:
        for seq in seqs:
            m = self.root.read_manifest(self.run, 1, seq)
            got = read_dump(self.root, self.run, 1, seq)
            for table, (keys, rows) in self.want[m.last_step].items():
                k, r, _, _ = got[table]
                order = np.argsort(k)
                assert np.array_equal(k[order], keys), (seq, table)
                assert np.array_equal(r[order], rows), (seq, table)


@pytest.mark.parametrize("device", DEVICES)
def test_a_spread_dump_holds_every_touched_row_at_its_dump_step(tmp_path, device):
    loop = Loop(tmp_path, device, every_steps=6, spread_steps=4)
    d = loop.dumper
    d.start(step=0)
    opened, windows = [], set()
    for step in range(1, 24):
        loop.step(step, twice=step % 3 == 0)
        opened.append(d.spread.open)
        windows.add(d.spread.last_window)
    d.final_dump(23)
    d.close()
    # the dumps at 6, 12 and 18 were read over the steps after them, not at their step
    assert d.spread.opened >= 3 and any(opened[6:9])
    # here a step reads at most 200 rows: windows the next dump (6 steps on) cut short
    assert 1 <= d.spread.finished_early <= d.spread.opened
    read_over = sorted(w[0] for w in windows if w is not None)
    assert read_over and read_over[0] >= 1 and read_over[-1] < 6  # read over the next steps
    assert d.spread.last_window[0] == 0  # the final dump: no step follows, read at once
    got = {m.name: m.samples[0].value for m in DumpCollector(d).collect()}
    assert got["deltarec_dump_spread"] == d.spread.opened
    assert got["deltarec_dump_spread_finished_early"] == d.spread.finished_early
    assert got["deltarec_dump_spread_last_window_steps"] == 0
    loop.remember(23)
    loop.check(range(1, 5))
    for name, w in loop.tables.items():
        et = expected_state(loop.root, "s", 1).tables[f"m.{name}"]
        assert np.array_equal(et.load(et.keys), w.cpu().numpy()[et.keys - OFFSETS[name]])


@pytest.mark.parametrize("device", DEVICES)
def test_the_next_dump_a_checkpoint_and_the_end_read_what_a_spread_dump_still_holds(
    tmp_path, device
):
    loop = Loop(tmp_path, device, every_steps=2, spread_steps=1000)  # never done in 2 steps
    d = loop.dumper
    d.start(step=0)
    for step in range(1, 6):
        loop.step(step)
        if step == 2:
            assert d.spread.open  # the dump at 2 is still being read
    assert d.spread.open
    d.wait_idle(timeout=60)  # before a checkpoint: every dump so far committed
    assert not d.spread.open
    assert d.spread.finished_early == 2  # the dump at 2 read at 4, the one at 4 by the wait
    assert d.root.read_manifest("s", 1, 2).last_step == 4
    loop.step(6)
    loop.step(7)
    d.final_dump(7)
    d.close()
    loop.remember(7)
    loop.check(range(1, 5))


@pytest.mark.parametrize("device", DEVICES)
def test_evaluation_lookups_in_a_spread_window_change_nothing_that_is_dumped(tmp_path, device):
    loop = Loop(tmp_path, device, every_steps=3, spread_steps=50)
    d = loop.dumper
    d.start(step=0)
    for step in range(1, 4):
        loop.step(step)
    assert d.spread.open
    d.before_eval()
    for _ in range(3):
        loop.step(0, n=300, train=False)  # recorded, never trained on
    d.after_eval()
    for step in range(4, 8):
        loop.step(step)
    d.final_dump(7)
    d.close()
    loop.remember(7)
    loop.check(range(1, 3))


def test_a_tracker_that_cannot_be_watched_takes_the_exact_path(tmp_path):
    class ReadOnly:
        """A tracker answering ``get_unique()`` alone: lookups cannot be seen as recorded."""

        def __init__(self) -> None:
            self.inner = ManualTracker()

        def get_unique(self):
            return self.inner.get_unique()

    loop = Loop(tmp_path, "cpu", every_steps=3, spread_steps=4)
    plain = ReadOnly()
    loop.tracker = plain.inner
    loop.hub.tracker = plain
    d = loop.dumper
    d.start(step=0)
    for step in range(1, 6):
        loop.step(step)
    d.final_dump(5)
    d.close()
    assert d.spread.opened == 0
    loop.remember(5)
    loop.check(range(1, 3))


def test_the_store_of_torchrecs_tracker_is_watched_on_its_instance():
    class Store:
        def __init__(self) -> None:
            self.per_fqn_lookups: dict = {}

        def append(self, batch_idx, fqn, ids, states=None, raw_ids=None):
            self.per_fqn_lookups.setdefault(fqn, []).append(ids)

    class Tracker:
        def __init__(self) -> None:
            self.store = Store()

    original = Store.append
    tracker, seen = Tracker(), []
    hub = TrackerHub(tracker, {"t"})
    assert hub.watch("t", seen.append)
    tracker.store.append(batch_idx=0, fqn="t", ids=torch.tensor([3, 4]))
    tracker.store.append(1, "u", torch.tensor([5]))  # another path: not watched
    hub.unwatch("t")
    tracker.store.append(batch_idx=2, fqn="t", ids=torch.tensor([6]))
    assert [x.tolist() for x in seen] == [[3, 4]]
    assert "append" in vars(tracker.store) and Store.append is original  # the class untouched
    assert tracker.store.per_fqn_lookups["t"][1].tolist() == [6]  # still recorded


def test_host_rows_keep_the_valid_rows_in_place():
    keys = torch.tensor([5, 2, 8, 9, 3, 7])
    rows = torch.arange(12, dtype=torch.float32).view(6, 2)
    valid = torch.tensor([True, True, False, False, True, True])
    host = HostRows(keys, rows, torch.zeros(6, dtype=torch.int8), valid=valid)
    base = host.rows.data_ptr()
    host.wait()
    assert host.keys.tolist() == [5, 2, 3, 7]
    assert host.rows.tolist() == [[0.0, 1.0], [2.0, 3.0], [8.0, 9.0], [10.0, 11.0]]
    assert len(host.ops) == 4 and host.rows.data_ptr() == base  # same memory, front part
    host.wait()  # idempotent
    assert host.keys.tolist() == [5, 2, 3, 7]


@pytest.mark.parametrize("device", DEVICES)
def test_the_warm_up_reads_one_row_a_table_and_changes_nothing(device):
    tables = [torch.randn(n, 4, device=device) for n in (5, 1)]
    before = [t.clone() for t in tables]
    spread.warm_up_spread(tables, [0, 100])
    assert all(torch.equal(a, b) for a, b in zip(tables, before, strict=True))
