"""The dump's deduplication of several tables at once, into lengths the host knows."""

from __future__ import annotations

import pytest
import torch

from deltarec.tracking.gather import dedup_ids
from deltarec.tracking.unique import UniqueBatch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


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
