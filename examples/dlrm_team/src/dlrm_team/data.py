"""Synthetic click batches for the DLRM: dense features, three sparse features, a label."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dlrm_team.tables import TABLES

DENSE_FEATURES = 4


@dataclass
class Batch:
    """One batch of one rank."""

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor


def make_batch(step: int, rank: int, batch_size: int) -> Batch:
    """The batch of ``step`` on ``rank``: Zipf-ish ids, 1-3 ids per feature and sample."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    keys, values, lengths = [], [], []
    for feature, rows in TABLES.values():
        n = torch.randint(1, 4, (batch_size,), generator=g)
        ids = (torch.rand(int(n.sum()), generator=g) ** 3 * rows).long().clamp(max=rows - 1)
        keys.append(feature)
        values.append(ids)
        lengths.append(n)
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.cat(values), lengths=torch.cat(lengths)
    )
    dense = torch.rand(batch_size, DENSE_FEATURES, generator=g)
    labels = (torch.rand(batch_size, generator=g) < 0.3).float()
    return Batch(dense, sparse, labels)
