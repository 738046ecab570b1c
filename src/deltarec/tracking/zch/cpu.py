"""Model set-up fixes for managed-collision (ZCH) tables, needed to train them on CPU.

These are part of building the model, not of dumping: call
:func:`prepare_zch_for_training` once after the model is built (and DMP-sharded), before the
first training step, whether or not a dumper is used. Both fixes act on module instances;
no torchrec or fbgemm class is patched.

1. ``MCHManagedCollisionModule`` sizes its eviction-history buffer from the FIRST training
   batch (``ids * eviction_interval * 1.25``); ids beyond it in later, larger batches are
   silently never admitted. :func:`presize_zch_history` sizes it up front from the largest
   number of ids a module can see in one step.
2. With fused ``RowWiseAdagrad`` (EXACT_ROWWISE_ADAGRAD) a sharded MC table resets the rows of
   evicted slots with ``fbgemm::reset_weight_momentum``, which has no CPU kernel
   (``NotImplementedError`` at the first admission). :func:`install_cpu_eviction_reset` gives
   each CPU TBE of an MC table an instance-level ``reset_embedding_weight_momentum`` that zeroes
   the rows and their momentum through the TBE's own views (torchrec then re-initialises the
   rows with the table's ``init_fn``, as on CUDA). TBEs with device weights keep fbgemm's op.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["install_cpu_eviction_reset", "prepare_zch_for_training", "presize_zch_history"]

_RESET = "reset_embedding_weight_momentum"


def prepare_zch_for_training(model: torch.nn.Module, max_ids_per_step: int) -> dict[str, int]:
    """Apply both fixes; return how many MCH modules / TBEs each one touched.

    Args:
        model: the model (DMP-wrapped or not) holding managed-collision tables.
        max_ids_per_step: the most raw ids one MCH module can receive in one training step;
            for a sharded table that is the ids of the table's features in the GLOBAL batch
            (all ranks), since any rank's shard may receive all of them.
    """
    return {
        "history_presized": presize_zch_history(model, max_ids_per_step),
        "cpu_reset_installed": install_cpu_eviction_reset(model),
    }


def presize_zch_history(model: torch.nn.Module, max_ids_per_step: int) -> int:
    """Size every not-yet-sized MCH history buffer for ``max_ids_per_step`` ids per step.

    Returns:
        The number of MCH modules sized now (modules already sized are left alone).

    Raises:
        ValueError: if ``max_ids_per_step < 1``.
    """
    from torchrec.modules.mc_modules import MCHManagedCollisionModule
    from torchrec.sparse.jagged_tensor import JaggedTensor

    if max_ids_per_step < 1:
        raise ValueError(f"max_ids_per_step must be >= 1, got {max_ids_per_step}")
    sized = 0
    for module in model.modules():
        if not isinstance(module, MCHManagedCollisionModule):
            continue
        if module._input_history_buffer_size != -1:
            continue
        device = module._mch_sorted_raw_ids.device
        values = torch.zeros(max_ids_per_step, dtype=torch.int64, device=device)
        lengths = torch.ones(max_ids_per_step, dtype=torch.int32, device=device)
        module._init_history_buffers({"presize": JaggedTensor(values=values, lengths=lengths)})
        sized += 1
    return sized


def install_cpu_eviction_reset(model: torch.nn.Module) -> int:
    """Give CPU rowwise-Adagrad TBEs of sharded MC tables a working eviction reset.

    Returns:
        The number of TBE instances that got the CPU reset (0 on CUDA or for other optimizers).
    """
    from torchrec.distributed.mc_embedding_modules import (
        BaseShardedManagedCollisionEmbeddingCollection,
    )

    installed = 0
    seen: set[int] = set()
    for module in model.modules():
        if not isinstance(module, BaseShardedManagedCollisionEmbeddingCollection):
            continue
        for tbe, _ in module._table_to_tbe_and_index.values():
            if id(tbe) in seen or not _needs_cpu_reset(tbe):
                continue
            seen.add(id(tbe))
            tbe.__dict__[_RESET] = _cpu_reset_for(tbe)
            installed += 1
    return installed


def _needs_cpu_reset(tbe: Any) -> bool:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    host = getattr(tbe, "weights_host", None)
    on_cpu = host is not None and host.numel() > 0 and tbe.weights_dev.numel() == 0
    return bool(on_cpu and tbe.optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD)


def _cpu_reset_for(tbe: Any) -> Any:
    def reset(
        pruned_indices: torch.Tensor,
        pruned_indices_offsets: torch.Tensor,
        logical_table_ids: torch.Tensor,
        buffer_ids: torch.Tensor,
    ) -> None:
        offsets = pruned_indices_offsets.tolist()
        weights = tbe.split_embedding_weights()
        states = tbe.split_optimizer_states()
        with torch.no_grad():
            for i, t in enumerate(logical_table_ids.tolist()):
                rows = pruned_indices[offsets[i] : offsets[i + 1]].long()
                weights[t][rows] = 0
                for state in states[t]:
                    state[rows] = 0

    return reset
