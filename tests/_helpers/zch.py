"""Small managed-collision models and an independent reading of their state for the ZCH tests."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from torchrec.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)

from deltarec.tracking.types import TouchedRows
from deltarec.tracking.zch.cpu import presize_zch_history

DIM = 4
SHARDED_ZCH = 16  # 8 rows per rank of 2, 7 usable
EMPTY = torch.iinfo(torch.int64).max
POLICIES = {
    "lfu": LFU_EvictionPolicy,
    "lru": LRU_EvictionPolicy,
    "dlfu": DistanceLFU_EvictionPolicy,
}


def mch(zch_size: int, policy: str, interval: int, hash_size: int, name: str):
    return MCHManagedCollisionModule(
        zch_size=zch_size,
        device=torch.device("cpu"),
        eviction_policy=POLICIES[policy](),
        eviction_interval=interval,
        input_hash_size=hash_size,
        name=name,
    )


class ZchModel(nn.Module):
    """One MC-EBC table ``bag`` (feature ``f_bag``) and one MC-EC table ``seq`` (``f_seq``)."""

    def __init__(
        self,
        zch_size: int,
        policy: str,
        interval: int = 1,
        hash_size: int = 1_000_000,
        seq_policy: str | None = None,
    ) -> None:
        super().__init__()
        seq_policy = seq_policy or policy
        bag = [
            EmbeddingBagConfig(
                name="bag", embedding_dim=DIM, num_embeddings=zch_size, feature_names=["f_bag"]
            )
        ]
        seq = [
            EmbeddingConfig(
                name="seq", embedding_dim=DIM, num_embeddings=zch_size, feature_names=["f_seq"]
            )
        ]
        self.mc_ebc = ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(bag),
            ManagedCollisionCollection(
                {"bag": mch(zch_size, policy, interval, hash_size, "bag")}, bag
            ),
            return_remapped_features=True,
        )
        self.mc_ec = ManagedCollisionEmbeddingCollection(
            EmbeddingCollection(seq),
            ManagedCollisionCollection(
                {"seq": mch(zch_size, seq_policy, interval, hash_size, "seq")}, seq
            ),
            return_remapped_features=True,
        )

    def forward(self, kb: KeyedJaggedTensor, ks: KeyedJaggedTensor) -> torch.Tensor:
        kt, _ = self.mc_ebc(kb)
        seq, _ = self.mc_ec(ks)
        return kt.values().pow(2).sum() + sum(jt.values().pow(2).sum() for jt in seq.values())


def kjts(ids: list[int]) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
    values = torch.tensor(ids, dtype=torch.int64)
    lengths = torch.ones(len(ids), dtype=torch.int32)
    return (
        KeyedJaggedTensor.from_lengths_sync(["f_bag"], values, lengths),
        KeyedJaggedTensor.from_lengths_sync(["f_seq"], values.clone(), lengths.clone()),
    )


def apply(state: dict[int, np.ndarray], touched: TouchedRows) -> dict[str, int]:
    """Replay collected rows onto a raw id → row map (latest wins, op 1 removes)."""
    keys = touched.keys.tolist()
    assert len(set(keys)) == len(keys), "a key appears twice in one collect"
    rows = touched.rows.detach().cpu().numpy()
    ops = touched.ops.tolist()
    for key, row, op in zip(keys, rows, ops, strict=True):
        if op == 1:
            assert key != -1, "the fallback key is never evicted"
            state.pop(key, None)
        else:
            state[key] = row.copy()
    return {"upserts": ops.count(0), "evicted": ops.count(1)}


def model_state(
    mch_module: nn.Module, weight: torch.Tensor, row_offset: int, with_fallback: bool
) -> dict[int, np.ndarray]:
    """Every raw id the MCH module holds with its row, read by a full scan (the reference)."""
    ids = mch_module._mch_sorted_raw_ids.tolist()
    slots = mch_module._mch_remapped_ids_mapping.tolist()
    w = weight.detach().cpu().numpy()
    state = {
        raw: w[slot - row_offset].copy()
        for raw, slot in zip(ids[:-1], slots[:-1], strict=True)
        if raw != EMPTY
    }
    if with_fallback:
        miss = int(mch_module._output_global_offset) + int(mch_module._zch_size) - 1
        state[-1] = w[miss - row_offset].copy()
    return state


def assert_same_state(got: dict[int, np.ndarray], want: dict[int, np.ndarray]) -> None:
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    assert not missing and not extra, f"keys missing {missing[:10]} extra {extra[:10]}"
    for key, row in want.items():
        np.testing.assert_array_equal(got[key], row, err_msg=f"row of key {key}")


def stream(
    step: int, seed: int, batch: int = 64, halves: int = 1, half: int = 500_000
) -> list[int]:
    """Ids of one step that force admissions and evictions under LRU, LFU and DistanceLFU.

    Three fresh ids per step, each repeated ``step + 2`` times (so their count beats every
    older id that is not looked up again), then single ids drawn from a small pool (misses,
    re-admissions of evicted ids). With ``halves == 2`` ids alternate between the two raw-id
    halves that a 2-rank sharded table routes to rank 0 and rank 1.
    """
    rng = np.random.default_rng(seed * 7919 + step)
    ids: list[int] = []
    for j in range(3 * halves):
        fresh = 1000 * (step + 1) + 10 * seed + j
        ids += [fresh + (j % halves) * half] * (step + 2)
    pool = rng.integers(0, 60, size=batch)
    ids += [int(p) + (int(p) % halves) * half for p in pool]
    return ids[:batch] if len(ids) > batch else ids


def build_sharded(world_size: int) -> tuple[Any, torch.optim.Optimizer]:
    """The ZchModel (bag: LRU, seq: LFU) row-wise sharded by DMP, fused RowWiseAdagrad."""
    from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
    from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    torch.manual_seed(0)
    model = ZchModel(zch_size=SHARDED_ZCH, policy="lru", seq_policy="lfu")
    apply_optimizer_in_backward(RowWiseAdagrad, list(model.parameters()), {"lr": 0.5})
    bag, seq = (
        ManagedCollisionEmbeddingBagCollectionSharder(),
        ManagedCollisionEmbeddingCollectionSharder(),
    )
    plan = ShardingPlan(
        {
            name: construct_module_sharding_plan(
                getattr(model, name),
                {table: row_wise(compute_kernel="fused")},
                sharder=sharder,
                local_size=world_size,
                world_size=world_size,
                device_type="cpu",
            )
            for name, table, sharder in (("mc_ebc", "bag", bag), ("mc_ec", "seq", seq))
        }
    )
    dmp = DistributedModelParallel(
        model, device=torch.device("cpu"), plan=plan, sharders=[bag, seq]
    )
    return dmp, dmp.fused_optimizer


def model_parts(model: ZchModel) -> dict[str, tuple[torch.nn.Module, torch.Tensor]]:
    """Per table of an unsharded :class:`ZchModel`: its MCH module and its weight."""
    return {
        "mc_ebc.bag": (
            model.mc_ebc._managed_collision_collection._managed_collision_modules["bag"],
            model.mc_ebc._embedding_module.embedding_bags["bag"].weight,
        ),
        "mc_ec.seq": (
            model.mc_ec._managed_collision_collection._managed_collision_modules["seq"],
            model.mc_ec._embedding_module.embeddings["seq"].weight,
        ),
    }


def sharded_parts(dmp: Any) -> dict[str, tuple[Any, torch.Tensor, int]]:
    out = {}
    for table, owner, group in (
        ("bag", "mc_ebc", "embedding_bags"),
        ("seq", "mc_ec", "embeddings"),
    ):
        smc = getattr(dmp.module, owner)
        mcc = smc._managed_collision_collection
        weight = getattr(smc._embedding_module, group).get_parameter(f"{table}.weight")
        out[f"{owner}.{table}"] = (
            mcc._managed_collision_modules[table],
            weight,
            mcc._table_to_offset[table],
        )
    return out


def train_step(dmp: Any, opt: torch.optim.Optimizer, ids: list[int]) -> None:
    opt.zero_grad()
    dmp(*kjts(ids)).backward()
    opt.step()


def presized_model(
    zch_size: int, policy: str, history: int, interval: int = 1
) -> tuple[ZchModel, torch.optim.Optimizer]:
    """A :class:`ZchModel` whose eviction history has room for ``history`` ids from the start
    (no resize in the middle of a test), and its SGD optimizer."""
    model = ZchModel(zch_size=zch_size, policy=policy, interval=interval)
    presize_zch_history(model, history)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)
