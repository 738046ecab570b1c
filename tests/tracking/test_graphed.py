"""Graphed dumps: one CUDA graph replay deduplicates and gathers several tables' rows.

The replays are compared with the exact path (sorted unique ids, their rows) on the same
recorded ids. On CPU a set runs its body eagerly (the body and the buffers' layout are checked
everywhere); on CUDA the body is captured and replayed.
"""

from __future__ import annotations

import pytest
import torch

from deltarec.tracking.graphed import (
    GRAPH_MIN_IDS,
    SORT_RATIO,
    GraphedGather,
    GraphedSet,
    capacity_within,
    set_bytes,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _want(w: torch.Tensor, ids: list[torch.Tensor], offset: int) -> tuple[torch.Tensor, ...]:
    unique = torch.unique(torch.cat(ids)) if ids else torch.empty(0, dtype=torch.int64)
    unique = unique.to(w.device)
    return unique + offset, w[unique]


@pytest.mark.parametrize("device", DEVICES)
def test_a_replay_gives_each_table_exactly_its_unique_rows_dump_after_dump(device: str) -> None:
    gen = torch.Generator(device=device).manual_seed(5)
    cap = 2048
    # the first table sorts its ids (many rows per id of capacity), the second marks a bitmap
    ws = [torch.randn(SORT_RATIO * cap + 1, 8, device=device), torch.randn(3000, 4, device=device)]
    offsets = [0, 10_000]
    s = GraphedSet(ws, offsets, [cap, cap])
    assert s.bitmaps[0] is None and s.bitmaps[1] is not None
    s.capture()
    cases = [
        [[torch.randint(0, 100, (700,), device=device, generator=gen)] * 2, []],  # dups, none
        [[], [torch.tensor([0, 2999, 0, 2999], device=device)]],  # the first and last rows
        [  # the whole capacity, one part each
            [torch.randint(0, ws[0].shape[0], (cap,), device=device, generator=gen)],
            [torch.randperm(3000, device=device, generator=gen)[:cap]],
        ],
    ]
    for recorded in cases:
        counts = [sum(int(p.numel()) for p in parts) for parts in recorded]
        got = s.run(recorded, counts)
        assert not s.free
        for i, rows in enumerate(got):
            rows.resolve()
            keys, values = _want(ws[i], recorded[i], offsets[i])
            assert torch.equal(rows.keys, keys) and torch.equal(rows.rows, values)
            assert len(rows) == len(keys) and rows.ops.shape == (len(keys),)
            rows.release()
            rows.release()  # idempotent
        assert s.free


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_replay_reads_the_rows_as_they_are_at_its_place_in_the_stream() -> None:
    w = torch.zeros(5000, 4, device="cuda")
    s = GraphedSet([w], [0], [GRAPH_MIN_IDS])
    s.capture()
    ids = torch.arange(0, 50, device="cuda")
    w[ids] = 1.0
    (got,) = s.run([[ids]], [50])
    w[ids] = 2.0  # the next step, queued behind the replay
    got.resolve()
    assert torch.equal(got.rows, torch.ones(50, 4, device="cuda"))
    got.release()


def test_a_capacity_is_the_largest_power_of_two_within_the_limit() -> None:
    ws = [torch.empty(10**6, 16), torch.empty(10**6, 8)]
    per_id = (64 + 16) + (32 + 16)
    assert capacity_within(ws, 4096 * per_id) == 4096
    assert capacity_within(ws, 4096 * per_id - 1) == 2048
    assert capacity_within(ws, GRAPH_MIN_IDS * per_id - 1) == 0
    small = [torch.empty(5000, 4)]  # a bitmap of its rows counts too
    assert set_bytes(small, [1024]) == 1024 * (16 + 16) + 5001


@pytest.mark.parametrize("device", DEVICES)
def test_the_two_sets_take_turns_and_a_dump_they_cannot_take_goes_the_exact_way(
    device: str,
) -> None:
    ws = [torch.randn(100_000, 16, device=device), torch.randn(50_000, 8, device=device)]
    g = GraphedGather(ws, [0, 7], limit=set_bytes(ws, [2048, 2048]))
    assert g.capacity == 2048 and len(g.sets) == 2 and g.nbytes == 2 * set_bytes(ws, [2048] * 2)
    small = [[torch.arange(10, device=device)], [torch.arange(20, device=device)]]
    assert g.try_run([[], []]) is None and g.misses == 0  # nothing recorded
    a, b = g.try_run(small), g.try_run(small)
    assert a is not None and b is not None
    assert g.try_run(small) is None and g.misses == 1  # both sets busy
    for rows in a:
        rows.release()
    c = g.try_run(small)
    assert c is not None and g.runs == 3
    big = [[torch.arange(2049, device=device)], []]
    assert g.try_run(big) is None and g.misses == 2  # more ids than a set holds
    for i, rows in enumerate(c):
        rows.resolve()
        assert torch.equal(rows.keys, small[i][0] + [0, 7][i])
        assert torch.equal(rows.rows, ws[i][small[i][0]])
        rows.release()
    for rows in b:
        rows.release()
    g.close()
    assert g.try_run(small) is None


def test_a_limit_too_small_for_the_smallest_capacity_makes_no_graph() -> None:
    w = torch.randn(100_000, 16)
    g = GraphedGather([w], [0], limit=1024)
    assert g.capacity == 0 and g.sets == [] and g.nbytes == 0
    assert g.try_run([[torch.arange(10)]]) is None
