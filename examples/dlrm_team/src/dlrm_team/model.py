"""The team's model, sharded with DMP.

torchrec's DLRM over an EmbeddingBagCollection, plus an item-sequence tower over an
EmbeddingCollection that reads the same feature ``f_item`` (one feature, two modules).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dlrm_team.data import DENSE_FEATURES
from dlrm_team.tables import EBC_FQN, EC_FQN, EMBEDDING_DIM, SEQ_DIM, SEQ_TABLES, TABLES


class ItemSeq(torch.nn.Module):
    """The item ids as a sequence: an EmbeddingCollection, sum-pooled, one linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(
            tables=[
                EmbeddingConfig(
                    name=name, embedding_dim=SEQ_DIM, num_embeddings=rows, feature_names=[feature]
                )
                for name, (feature, rows) in SEQ_TABLES.items()
            ],
            device=torch.device("meta"),
        )
        self.linear = torch.nn.Linear(SEQ_DIM, 1)

    def forward(self, seq: KeyedJaggedTensor) -> torch.Tensor:
        """One logit per sample."""
        pooled = 0
        for jt in self.ec(seq).values():
            lengths = jt.lengths()
            row = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
            zeros = torch.zeros(lengths.numel(), SEQ_DIM)
            pooled = pooled + zeros.index_add(0, row, jt.values())
        return self.linear(pooled).squeeze(-1)


class ClickDLRM(torch.nn.Module):
    """DLRM and the item tower plus the loss: ``forward(dense, sparse, seq, labels) -> loss``."""

    def __init__(self) -> None:
        super().__init__()
        ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name=name,
                    embedding_dim=EMBEDDING_DIM,
                    num_embeddings=rows,
                    feature_names=[feature],
                )
                for name, (feature, rows) in TABLES.items()
            ],
            device=torch.device("meta"),
        )
        self.dlrm = DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=DENSE_FEATURES,
            dense_arch_layer_sizes=[16, EMBEDDING_DIM],
            over_arch_layer_sizes=[16, 1],
        )
        self.item_seq = ItemSeq()
        self.loss = torch.nn.BCEWithLogitsLoss()

    def forward(
        self,
        dense: torch.Tensor,
        sparse: KeyedJaggedTensor,
        seq: KeyedJaggedTensor,
        labels: torch.Tensor,
    ) -> torch.Tensor:
        """The mean BCE loss of the batch."""
        logits = self.dlrm(dense, sparse).squeeze(-1) + self.item_seq(seq)
        return self.loss(logits, labels)


def is_embedding(name: str) -> bool:
    """Whether a parameter or state-dict key is an embedding table's weight."""
    return ".embedding_bags." in name or ".embeddings." in name


def build(device: torch.device) -> tuple[DistributedModelParallel, torch.optim.Optimizer]:
    """The sharded model (one row-wise table, the others table-wise) and its dense optimizer.

    The embedding rows are updated in backward by torchrec's fused Adagrad.
    """
    torch.manual_seed(0)
    model = ClickDLRM()
    embeddings = [*model.dlrm.sparse_arch.parameters(), *model.item_seq.ec.parameters()]
    apply_optimizer_in_backward(torch.optim.Adagrad, embeddings, {"lr": 0.1})
    world = dist.get_world_size()
    per_table = {
        "t_user": row_wise(),
        "t_item": table_wise(rank=0),
        "t_site": table_wise(rank=world - 1),
    }
    bags, seqs = EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()
    plan = ShardingPlan(
        {
            EBC_FQN: construct_module_sharding_plan(
                model.dlrm.sparse_arch.embedding_bag_collection,
                per_param_sharding=per_table,
                local_size=world,
                world_size=world,
                device_type=device.type,
                sharder=bags,
            ),
            EC_FQN: construct_module_sharding_plan(
                model.item_seq.ec,
                per_param_sharding={name: table_wise(rank=world - 1) for name in SEQ_TABLES},
                local_size=world,
                world_size=world,
                device_type=device.type,
                sharder=seqs,
            ),
        }
    )
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=[bags, seqs])
    dense = [p for n, p in dmp.named_parameters() if not is_embedding(n)]
    return dmp, torch.optim.Adagrad(dense, lr=0.05)
