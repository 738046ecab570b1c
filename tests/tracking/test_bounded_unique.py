"""The dump's deduplication of several tables at once, into lengths the host knows."""

from __future__ import annotations

import pytest
import torch

from deltarec.tracking import unique
from deltarec.tracking.device_budget import DeviceBudget
from deltarec.tracking.gather import CountedRows, dedup_ids
from deltarec.tracking.unique import UniqueBatch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
PAD = 256 << 20  # the padding a counted dump may gather, when turned on


@pytest.mark.parametrize("device", DEVICES)
def test_a_batch_gives_each_table_its_sorted_unique_ids_dump_after_dump(device: str) -> None:
    gen = torch.Generator().manual_seed(3)
    rows = [1000, 7, 1 << 20, 1000]
    batch = UniqueBatch(rows, torch.device(device))
    for sizes in [(50, 40, 3, 5000), (5000, 0, 100_000, 1), (1, 1, 1, 1)]:
        recorded = [
            torch.randint(0, r, (n,), generator=gen).to(device, torch.int32) if n else None
            for r, n in zip(rows, sizes, strict=True)
        ]
        dump = batch.queue(recorded)
        for i, ids in enumerate(recorded):
            want = dedup_ids(ids.cpu()) if ids is not None else torch.empty(0, dtype=torch.int64)
            got = dump.ids(i)
            assert got.dtype == torch.int64 and got.device.type == device
            assert torch.equal(got.cpu(), want)
        assert not bool(batch.bitmap.any())  # cleared for the next dump


def test_warming_up_leaves_the_batch_clear_and_the_tables_unchanged() -> None:
    ws = [torch.randn(30, 4), torch.randn(5, 2)]
    before = [w.clone() for w in ws]
    batch = UniqueBatch([30, 5], torch.device("cpu"))
    batch.warm_up(ws)
    assert not bool(batch.bitmap.any())
    assert all(torch.equal(a, b) for a, b in zip(ws, before, strict=True))
    dump = batch.queue([torch.tensor([3, 3, 29]), torch.tensor([4])])
    assert dump.ids(0).tolist() == [3, 29] and dump.ids(1).tolist() == [4]


def test_a_batch_without_any_recorded_id_queues_nothing() -> None:
    batch = UniqueBatch([10, 20], torch.device("cpu"))
    dump = batch.queue([None, None])
    assert dump.unique is None
    assert dump.ids(0).numel() == 0 and dump.ids(1).numel() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_ids_marked_between_dumps_are_part_of_the_next_dump_and_forgotten_after_it(
    device: str,
) -> None:
    gen = torch.Generator().manual_seed(5)
    rows = [1000, 50, 1 << 16]
    batch = UniqueBatch(rows, torch.device(device))
    for _ in range(2):
        steps = [[torch.randint(0, r, (n,), generator=gen) for r in rows] for n in (300, 7, 90)]
        for step in steps[:-1]:  # marked as recorded, the last step's ids given to the dump
            for i, ids in enumerate(step):
                batch.mark(i, ids.to(device, torch.int32))
        assert batch.marked == [min(307, r) for r in rows]
        dump = batch.queue(steps[-1])
        for i in range(len(rows)):
            want = dedup_ids(torch.cat([step[i] for step in steps]))
            assert torch.equal(dump.ids(i).cpu(), want)
        assert batch.marked == [0, 0, 0] and not bool(batch.bitmap.any())


def test_clearing_a_table_forgets_its_marks_and_keeps_the_others() -> None:
    batch = UniqueBatch([10, 20], torch.device("cpu"))
    batch.mark(0, torch.tensor([1, 2, 2]))
    batch.mark(1, torch.tensor([19]))
    batch.clear(0)
    dump = batch.queue([None, torch.tensor([3])])
    assert dump.ids(0).tolist() == [] and dump.ids(1).tolist() == [3, 19]


def _resolved(rows: CountedRows) -> tuple[list[int], torch.Tensor]:
    rows.resolve()
    return rows.keys.cpu().tolist(), rows.rows.cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_a_counted_dump_gathers_each_tables_unique_rows_without_waiting_dump_after_dump(
    device: str,
) -> None:
    gen = torch.Generator().manual_seed(11)
    dev = torch.device(device)
    weights = [
        torch.randn(1000, 8).to(dev),
        torch.randn(40, 3).to(dev),
        torch.randn(5000, 4).to(dev),
    ]
    offsets = [0, 1000, 7]
    rows = [int(w.shape[0]) for w in weights]
    budget = DeviceBudget(0.0, capacity_bytes=1 << 30)
    batch = UniqueBatch(rows, dev)
    for _ in range(3):
        steps = [[torch.randint(0, r, (n,), generator=gen) for r in rows] for n in (200, 30, 9)]
        for step in steps[:2]:  # marked between dumps, then counted (as the dumper's absorb)
            for i, ids in enumerate(step):
                batch.mark(i, ids.to(dev))
        batch.count_marks()
        recorded = [s.to(dev) for s in steps[2]]
        got = batch.gather_counted(recorded, weights, offsets, budget, pad_bytes=PAD)
        assert got is not None and budget.held(dev) > 0
        for i, counted in enumerate(got):
            want = dedup_ids(torch.cat([step[i] for step in steps]))
            keys, values = _resolved(counted)
            assert keys == (want + offsets[i]).tolist()
            assert torch.equal(values, weights[i].cpu()[want])
            counted.release()
        assert budget.held(dev) == 0 and not bool(batch.bitmap.any())
        assert batch.bounds() == [0, 0, 0]


def test_a_counted_dump_bounds_each_table_by_its_last_count_and_the_ids_marked_since() -> None:
    batch = UniqueBatch([10, 20], torch.device("cpu"))
    batch.mark(0, torch.tensor([1, 2, 2]))
    batch.count_marks()
    batch.mark(0, torch.tensor([2, 3]))
    batch.mark(1, torch.tensor([5]))
    assert batch.bounds() == [4, 1]  # 2 rows counted + 2 ids since; 1 id since


def test_without_a_trusted_count_or_room_the_dump_falls_back_to_the_exact_path() -> None:
    weights = [torch.randn(10, 2), torch.randn(20, 2)]
    batch = UniqueBatch([10, 20], torch.device("cpu"))
    batch.mark(0, torch.tensor([1, 2]))
    batch.count_marks()
    batch.clear(0)  # the count on its way still holds table 0's old marks
    assert batch.gather_counted([None, torch.tensor([4])], weights, [0, 0], None, PAD) is None
    dump = batch.queue([None, None])  # the ids given to gather_counted stay marked
    assert dump.ids(0).tolist() == [] and dump.ids(1).tolist() == [4]

    full = DeviceBudget(0.0, capacity_bytes=8)  # room for no row
    assert batch.gather_counted([torch.tensor([3, 3]), None], weights, [0, 0], full, PAD) is None
    assert full.held(torch.device("cpu")) == 0
    assert batch.queue([None, None]).ids(0).tolist() == [3]

    batch.mark(1, torch.arange(20))  # 20 ids since the last clear: padding over the limit
    assert batch.gather_counted([None, None], weights, [0, 0], None, pad_bytes=16) is None
    assert batch.queue([None, None]).ids(1).tolist() == list(range(20))


def test_counted_dumps_are_off_by_default_and_warming_them_up_leaves_the_batch_clear(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    weights = [torch.randn(10, 2), torch.randn(20, 2)]
    batch = UniqueBatch([10, 20], torch.device("cpu"))
    assert not batch.counting
    assert batch.gather_counted([torch.tensor([1]), None], weights, [0, 0], None) is None
    assert batch.queue([None, None]).ids(0).tolist() == [1]
    monkeypatch.setattr(unique, "COUNTED_PAD_BYTES", PAD)
    batch.warm_up(weights)
    assert batch.counting and not bool(batch.bitmap.any()) and batch.bounds() == [0, 0]
    got = batch.gather_counted([torch.tensor([7, 7]), torch.tensor([19])], weights, [0, 5], None)
    assert got is not None
    assert [_resolved(g)[0] for g in got] == [[7], [24]]
