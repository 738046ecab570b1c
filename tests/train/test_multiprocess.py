"""The multi-rank helper: values come back in rank order, failures name the rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from deltarec.testing.multiprocess import RanksFailedError, run_on_ranks, spawn_ranks

pytestmark = pytest.mark.multiprocess


class _Boom(Exception):
    pass


def _sum_ranks_then_maybe_fail(rank: int, world_size: int, fail_rank: int) -> dict[str, int]:
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    if rank == fail_rank:
        raise _Boom(f"rank {rank} fails on purpose")
    return {"rank": rank, "world": world_size, "sum": int(t.item())}


def test_values_come_back_in_rank_order_and_failures_name_the_rank():
    results = run_on_ranks(_sum_ranks_then_maybe_fail, 2, args=(-1,))
    assert results == [{"rank": 0, "world": 2, "sum": 3}, {"rank": 1, "world": 2, "sum": 3}]

    outcomes = spawn_ranks(_sum_ranks_then_maybe_fail, 2, kwargs={"fail_rank": 1})
    assert outcomes[0].ok and outcomes[0].value["sum"] == 3
    assert isinstance(outcomes[1].error, _Boom)
    assert "fails on purpose" in outcomes[1].traceback

    assert "--- rank 1: _Boom" in str(RanksFailedError(outcomes))
