"""The dump's deduplication into a length the host knows, its count left on the device."""

from __future__ import annotations

import torch

from deltarec.tracking.gather import dedup_ids, unique_ids_bounded


def test_bounded_unique_holds_the_sorted_unique_ids_then_padding() -> None:
    gen = torch.Generator().manual_seed(3)
    for rows, n in [(1000, 50), (1000, 5000), (7, 40), (1 << 20, 3)]:
        ids = torch.randint(0, rows, (n,), generator=gen)
        padded, count = unique_ids_bounded(ids.view(-1, 1).to(torch.int32), rows)
        want = dedup_ids(ids)
        assert padded.dtype == torch.int64
        assert padded.shape == (min(n, rows),)  # the bound the host knew without asking
        assert int(count) == len(want)
        assert torch.equal(padded[: int(count)], want)
        assert bool((padded[int(count) :] == -1).all())
