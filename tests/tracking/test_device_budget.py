"""The device staging budget: whole tables, tables staged in part, and the counters."""

from __future__ import annotations

import torch

from deltarec.tracking.device_budget import DeviceBudget

DEV = torch.device("cpu")  # a fixed capacity needs no device


def test_a_table_that_fits_is_taken_whole_and_one_that_does_not_is_taken_in_part() -> None:
    budget = DeviceBudget(0.0, capacity_bytes=1000)
    assert budget.take_rows(DEV, 30, 10, "sparse.a") == 30  # 300 bytes
    assert budget.take_rows(DEV, 100, 10, "sparse.b", min_rows=50) == 70  # the 700 left
    assert budget.held(DEV) == 1000
    assert budget.take_rows(DEV, 5, 10, "sparse.c") == 0  # nothing left
    got = budget.metrics()
    assert (got["staged"], got["full"], got["split"], got["peak_bytes"]) == (2, 2, 1, 1000)


def test_a_part_smaller_than_the_minimum_is_not_staged() -> None:
    budget = DeviceBudget(0.0, capacity_bytes=1000)
    assert budget.take_rows(DEV, 200, 10, "sparse.a", min_rows=101) == 0
    assert budget.held(DEV) == 0
    got = budget.metrics()
    assert (got["staged"], got["full"], got["split"]) == (0, 1, 0)


def test_without_a_capacity_nothing_is_staged_and_nothing_counted() -> None:
    budget = DeviceBudget(0.0)
    assert budget.take_rows(DEV, 10, 10, "sparse.a") == 0
    got = budget.metrics()
    assert (got["staged"], got["full"], got["split"]) == (0, 0, 0)
