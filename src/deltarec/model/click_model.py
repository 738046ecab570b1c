"""The example DLRM-style click model (unsharded definition).

``ClickModel`` has a ``sparse`` submodule (:class:`SparseArch`) holding the three embedding
modules, so the table ids read ``sparse.ebc.<table>``, ``sparse.ec.history`` and
``sparse.zch.ad_id`` (SPEC §3). A dense MLP embeds the float features; an over-MLP on the
concatenation of everything predicts the click logit. ``forward`` returns
``(loss, logits)`` so the same module trains and evaluates.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)

from deltarec.model.config import HISTORY, ZCH_TABLE, ModelConfig, TableConfig

__all__ = ["HISTORY", "ZCH_TABLE", "ClickModel", "SparseArch"]


def _table_configs(
    config_type: type[EmbeddingBagConfig] | type[EmbeddingConfig], tables: dict[str, TableConfig]
) -> list[Any]:
    """One ``config_type`` per table, each looked up by the feature of the table's name."""
    return [
        config_type(
            name=name,
            embedding_dim=t.dim,
            num_embeddings=t.num_embeddings,
            feature_names=[name],
        )
        for name, t in tables.items()
    ]


class SparseArch(nn.Module):
    """The embedding modules: ``ebc`` (pooled tables), ``ec`` (sequence), ``zch`` (managed).

    Args:
        config: the model configuration.
        world_size: number of ranks; the ZCH table has ``zch_size_per_rank * world_size`` rows.
        device: where the (unsharded) modules are built; use ``meta`` before sharding.
    """

    def __init__(self, config: ModelConfig, world_size: int, device: torch.device) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            _table_configs(EmbeddingBagConfig, config.tables), device=device
        )
        self.ec = EmbeddingCollection(
            _table_configs(EmbeddingConfig, {HISTORY: config.history}), device=device
        )
        self.zch = _build_zch(config, world_size, device)

    def forward(
        self, bags: KeyedJaggedTensor, history: KeyedJaggedTensor, ads: KeyedJaggedTensor
    ) -> torch.Tensor:
        """Return ``[batch, pooled_dim]``: bag embeddings, mean history, ZCH bag embeddings."""
        pooled = self.ebc(bags).values()
        seq = self.ec(history)[HISTORY]
        zch_kt, _ = self.zch(ads)
        return torch.cat([pooled, _mean_pool(seq.values(), seq.lengths()), zch_kt.values()], 1)


def _build_zch(
    config: ModelConfig, world_size: int, device: torch.device
) -> ManagedCollisionEmbeddingBagCollection:
    z = config.zch
    tables = [
        EmbeddingBagConfig(
            name=ZCH_TABLE,
            embedding_dim=z.dim,
            num_embeddings=z.zch_size_per_rank * world_size,
            feature_names=[ZCH_TABLE],
        )
    ]
    policy = DistanceLFU_EvictionPolicy() if z.eviction_policy == "lfu" else LRU_EvictionPolicy()
    mch = MCHManagedCollisionModule(
        zch_size=z.zch_size_per_rank * world_size,
        device=device,
        eviction_policy=policy,
        eviction_interval=z.eviction_interval,
        input_hash_size=z.raw_id_space,
        name=ZCH_TABLE,
    )
    return ManagedCollisionEmbeddingBagCollection(
        EmbeddingBagCollection(tables, device=device),
        ManagedCollisionCollection({ZCH_TABLE: mch}, tables),
        return_remapped_features=False,
    )


def _mean_pool(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Mean of each sample's sequence rows (zeros for empty sequences): ``[batch, dim]``."""
    batch = lengths.numel()
    sample = torch.repeat_interleave(torch.arange(batch, device=values.device), lengths.long())
    total = torch.zeros(batch, values.shape[1], device=values.device, dtype=values.dtype)
    total = total.index_add(0, sample, values)
    return total / lengths.clamp(min=1).unsqueeze(1).to(values.dtype)


def _mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(sizes):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class ClickModel(nn.Module):
    """DLRM-style click model: ``sparse`` embeddings + dense MLP -> over MLP -> click logit.

    Args:
        config: the model configuration.
        world_size: number of ranks the model will be sharded over (sizes the ZCH table).
        device: device of the dense layers; ``sparse`` is built on ``sparse_device``.
        sparse_device: where the embedding modules are built (``meta`` before DMP sharding).
    """

    def __init__(
        self,
        config: ModelConfig,
        world_size: int,
        device: torch.device,
        sparse_device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.sparse = SparseArch(config, world_size, sparse_device or device)
        pooled = sum(t.dim for t in config.tables.values()) + config.history.dim + config.zch.dim
        self.dense_arch = _mlp([config.dense_features, config.hidden, config.hidden]).to(device)
        self.over_arch = _mlp([config.hidden + pooled, config.hidden, 1]).to(device)

    def forward(
        self,
        dense: torch.Tensor,
        bags: KeyedJaggedTensor,
        history: KeyedJaggedTensor,
        ads: KeyedJaggedTensor,
        labels: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(mean BCE loss, logits [batch])`` for one batch."""
        x = torch.cat([self.dense_arch(dense), self.sparse(bags, history, ads)], 1)
        logits = self.over_arch(x).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, labels)
        return loss, logits
