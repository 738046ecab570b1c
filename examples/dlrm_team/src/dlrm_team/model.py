"""The team's model: torchrec's DLRM over an EmbeddingBagCollection, sharded with DMP."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dlrm_team.data import DENSE_FEATURES
from dlrm_team.tables import EBC_FQN, EMBEDDING_DIM, TABLES


class ClickDLRM(torch.nn.Module):
    """DLRM plus its loss: ``forward(dense, sparse, labels) -> loss``."""

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
        self.loss = torch.nn.BCEWithLogitsLoss()

    def forward(
        self, dense: torch.Tensor, sparse: KeyedJaggedTensor, labels: torch.Tensor
    ) -> torch.Tensor:
        """The mean BCE loss of the batch."""
        return self.loss(self.dlrm(dense, sparse).squeeze(-1), labels)


def build(device: torch.device) -> tuple[DistributedModelParallel, torch.optim.Optimizer]:
    """The sharded model (one row-wise table, the others table-wise) and its dense optimizer.

    The embedding rows are updated in backward by torchrec's fused row-wise Adagrad.
    """
    torch.manual_seed(0)
    model = ClickDLRM()
    apply_optimizer_in_backward(
        torch.optim.Adagrad, model.dlrm.sparse_arch.parameters(), {"lr": 0.1}
    )
    world = dist.get_world_size()
    per_table = {
        "t_user": row_wise(),
        "t_item": table_wise(rank=0),
        "t_site": table_wise(rank=world - 1),
    }
    sharder = EmbeddingBagCollectionSharder()
    plan = ShardingPlan(
        {
            EBC_FQN: construct_module_sharding_plan(
                model.dlrm.sparse_arch.embedding_bag_collection,
                per_param_sharding=per_table,
                local_size=world,
                world_size=world,
                device_type=device.type,
                sharder=sharder,
            )
        }
    )
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=[sharder])
    dense = [p for n, p in dmp.named_parameters() if "embedding_bags" not in n]
    return dmp, torch.optim.Adagrad(dense, lr=0.05)
