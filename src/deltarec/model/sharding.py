"""Shard the example model with torchrec's DistributedModelParallel, with its optimizers.

Every sharding type appears once (see :mod:`deltarec.model.config`). Optimizers:

* sharded plain tables: fused ``RowWiseAdagrad`` (applied in backward by fbgemm's TBE; works
  on CPU and CUDA);
* the ZCH table: fused ``Adagrad`` by default (``ModelConfig.zch_optimizer``), because on
  admission/eviction the MC module calls ``fbgemm::reset_weight_momentum``, which has no CPU
  kernel and is only reached for row-wise Adagrad - plain Adagrad and SGD never call it;
* data-parallel tables and the MLPs: ``torch.optim.Adagrad`` over the DDP-replicated dense
  parameters (a data-parallel table is a dense parameter in torchrec).

MCH history buffer: torchrec sizes it from the first batch a shard sees, and silently stops
recording admission candidates once a later, bigger batch overflows it (gotcha 10). After
sharding, :func:`build_sharded_model` sizes each local MCH shard's buffer for the largest
possible routed batch (every rank sending all its ids to one shard), so no warm-up batch is
needed and no id is dropped from admission.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torchrec import JaggedTensor
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    ParameterShardingGenerator,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.mc_modules import MCHManagedCollisionModule
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from deltarec.model.click_model import HISTORY, ZCH_TABLE, ClickModel
from deltarec.model.config import ModelConfig, ShardingName
from deltarec.model.tables import TableInfo, model_tables
from deltarec.tracking.zch.cpu import install_cpu_eviction_reset


@dataclass
class ShardedModel:
    """The sharded example model and its optimizer.

    Attributes:
        dmp: the DistributedModelParallel module; ``dmp(*batch.model_inputs())`` returns
            ``(loss, logits)``.
        optimizer: fused (embedding) + dense optimizers in one ``CombinedOptimizer``; call
            ``zero_grad()`` / ``step()`` around ``loss.backward()`` (the fused part already
            updated the embedding rows during backward).
        config: the model configuration.
        tables: every table, in a fixed order (same on every rank).
        world_size: ranks the model is sharded over.
        device: this rank's device.
    """

    dmp: DistributedModelParallel
    optimizer: CombinedOptimizer
    config: ModelConfig
    tables: list[TableInfo]
    world_size: int
    device: torch.device

    def mch_modules(self) -> dict[str, MCHManagedCollisionModule]:
        """This rank's MCH shard modules, by table id."""
        return local_mch_modules(self.dmp)


def local_world_size(world_size: int) -> int:
    """Ranks per host (``LOCAL_WORLD_SIZE`` as torchrun sets it, else ``world_size``)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def _generator(sharding: ShardingName, world_size: int) -> ParameterShardingGenerator:
    if sharding == "table_wise":
        return table_wise(rank=0)
    if sharding == "row_wise":
        return row_wise()
    if sharding == "column_wise":
        # Two column shards, on ranks 0 and 1 (both on rank 0 when there is one rank).
        return column_wise(ranks=[0, 1 % world_size])
    if sharding == "data_parallel":
        return data_parallel()
    return table_row_wise(host_index=0)


def sharding_plan(
    model: ClickModel, config: ModelConfig, world_size: int, device_type: str
) -> ShardingPlan:
    """The plan: each EBC table as configured, ``history`` as configured, ZCH row-wise."""
    local = local_world_size(world_size)
    kw: dict[str, Any] = {"local_size": local, "world_size": world_size, "device_type": device_type}
    sparse = model.sparse
    ebc = {n: _generator(t.sharding, world_size) for n, t in config.tables.items()}
    ec = {HISTORY: _generator(config.history.sharding, world_size)}
    zch_sharder = ManagedCollisionEmbeddingBagCollectionSharder()
    return ShardingPlan(
        {
            "sparse.ebc": construct_module_sharding_plan(sparse.ebc, ebc, **kw),
            "sparse.ec": construct_module_sharding_plan(sparse.ec, ec, **kw),
            "sparse.zch": construct_module_sharding_plan(
                sparse.zch, {ZCH_TABLE: row_wise()}, sharder=zch_sharder, **kw
            ),
        }
    )


_ZCH_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adagrad": torch.optim.Adagrad,
    "sgd": torch.optim.SGD,
    "rowwise_adagrad": RowWiseAdagrad,
}


def _apply_fused_optimizers(model: ClickModel, config: ModelConfig) -> None:
    sparse = model.sparse
    fused = [
        p
        for n, p in sparse.ebc.named_parameters()
        if config.tables[n.split(".")[-2]].sharding != "data_parallel"
    ]
    fused += list(sparse.ec.parameters())
    lr = config.embedding_lr
    apply_optimizer_in_backward(RowWiseAdagrad, fused, {"lr": lr})
    zch_cls = _ZCH_OPTIMIZERS[config.zch_optimizer]
    apply_optimizer_in_backward(zch_cls, list(sparse.zch.parameters()), {"lr": lr})


def build_sharded_model(
    config: ModelConfig,
    device: torch.device,
    world_size: int | None = None,
    seed: int = 0,
    max_batch_size: int | None = None,
) -> ShardedModel:
    """Build, shard and wrap the example model on this rank (a collective: call on every rank).

    Args:
        config: the model configuration.
        device: this rank's device (``cpu``, or ``cuda:<local rank>``).
        world_size: ranks to shard over (default: the default process group's size).
        seed: seeds the dense layers' initialisation (identical on every rank).
        max_batch_size: the largest per-rank batch the model will train on; sizes the MCH
            history buffers. None leaves torchrec's default (sized from the first training
            batch, so that batch must then be the largest).

    Returns:
        The :class:`ShardedModel`.

    Raises:
        RuntimeError: if the default process group is not initialized.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_sharded_model needs an initialized default process group")
    world_size = world_size or dist.get_world_size()
    torch.manual_seed(seed)
    model = ClickModel(config, world_size, device=device, sparse_device=torch.device("cpu"))
    _apply_fused_optimizers(model, config)
    plan = sharding_plan(model, config, world_size, device.type)
    sharders = [
        EmbeddingBagCollectionSharder(),
        EmbeddingCollectionSharder(),
        ManagedCollisionEmbeddingBagCollectionSharder(),
    ]
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=cast(Any, sharders))
    install_cpu_eviction_reset(dmp)  # fused RowWiseAdagrad ZCH on CPU (a no-op otherwise)
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    optimizer = CombinedOptimizer(
        [
            ("fused", dmp.fused_optimizer),
            (
                "dense",
                KeyedOptimizerWrapper(
                    dense, lambda ps: torch.optim.Adagrad(ps, lr=config.dense_lr)
                ),
            ),
        ]
    )
    if max_batch_size:
        _presize_mch_history(dmp, world_size * max_batch_size * config.zch.ids_per_sample)
    return ShardedModel(
        dmp, optimizer, config, model_tables(config, world_size), world_size, device
    )


def local_mch_modules(dmp: nn.Module) -> dict[str, MCHManagedCollisionModule]:
    """This rank's MCH modules of the sharded model, by table id (``sparse.zch.ad_id``)."""
    out = {}
    for name, mod in dmp.named_modules():
        if isinstance(mod, MCHManagedCollisionModule) and name.split(".")[-1] == ZCH_TABLE:
            out[f"sparse.zch.{ZCH_TABLE}"] = mod
    return out


def _presize_mch_history(dmp: nn.Module, ids: int) -> None:
    """Size every local MCH history buffer for ``ids`` routed ids per step."""
    for mch in local_mch_modules(dmp).values():
        values = torch.zeros(ids, dtype=torch.int64, device=mch.device)
        lengths = torch.ones(ids, dtype=torch.int32, device=mch.device)
        mch._init_history_buffers({ZCH_TABLE: JaggedTensor(values=values, lengths=lengths)})
