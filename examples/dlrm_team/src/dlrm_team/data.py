"""Synthetic click batches for the team's model.

Each batch: dense features, three sparse features (for the DLRM's bags), the item ids again as
a sequence (for the item tower's EmbeddingCollection), a label.
"""

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
    seq: KeyedJaggedTensor
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
    item = keys.index("f_item")  # the same item ids, as a sequence for the EmbeddingCollection
    seq = KeyedJaggedTensor.from_lengths_sync(
        keys=["f_item"], values=values[item], lengths=lengths[item]
    )
    dense = torch.rand(batch_size, DENSE_FEATURES, generator=g)
    labels = (torch.rand(batch_size, generator=g) < 0.3).float()
    return Batch(dense, sparse, seq, labels)
