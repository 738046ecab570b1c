"""Full export of every table, read independently of the dumper (the oracle for dump tests).

``export_tables`` reads each table through ``dmp.state_dict()`` - ShardedTensors gathered
whole onto rank 0 (row-wise, table-row-wise and column-wise shards come out as one table),
DTensors via ``full_tensor()``, data-parallel tables from rank 0's replica - and writes
``<dir>/<table id>.parquet`` with columns ``key`` (int64) and ``embedding`` (fixed-size list
of float32), sorted by key.

Plain tables: one row per table row, ``key`` = global row index. ZCH tables: one row per raw
id the MCH shards hold (read from the ``_mch_sorted_raw_ids`` / ``_mch_remapped_ids_mapping``
buffers in the state dict; empty entries and each shard's unreachable last entry skipped),
``key`` = raw id, plus key ``-1`` for the fallback (miss) row. Each MCH shard has its own miss
slot (its last row); the exported ``-1`` row is the first shard's (rank 0's) miss slot,
global row ``zch_size_per_rank - 1``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

from deltarec.model.sharding import ShardedModel
from deltarec.model.tables import TableInfo

_EMPTY = torch.iinfo(torch.int64).max


def full_tensor(value: torch.Tensor) -> torch.Tensor | None:
    """The whole tensor on rank 0 (on CPU), None elsewhere; a collective for sharded values."""
    rank = dist.get_rank()
    if isinstance(value, ShardedTensor):
        local = value.local_shards()
        device = local[0].tensor.device if local else _pg_device()
        out = torch.empty(value.size(), dtype=value.dtype, device=device) if rank == 0 else None
        # ShardedTensor.gather stages through the *default* dtype (float32) unless told
        # otherwise: int64 raw ids above 2**24 would come back rounded, int64 max as int64 min.
        value.gather(dst=0, out=out, dtype=value.dtype)
        return out.cpu() if out is not None else None
    if isinstance(value, DTensor):
        whole = value.full_tensor()
        return whole.cpu() if rank == 0 else None
    return value.detach().cpu() if rank == 0 else None


def _pg_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def table_rows(
    model: ShardedModel, table: TableInfo, state: dict[str, Any] | None = None
) -> tuple[np.ndarray, np.ndarray] | None:
    """``(keys int64 [n], rows float32 [n, dim])`` of one table on rank 0, None elsewhere.

    A collective: call on every rank with the same table. ``state`` is ``dmp.state_dict()``
    if the caller already has it.
    """
    sd = model.dmp.state_dict() if state is None else state
    weight = full_tensor(sd[table.weight_key])
    if table.kind != "zch":
        if weight is None:
            return None
        keys = np.arange(weight.shape[0], dtype=np.int64)
        return keys, weight.float().numpy()
    raw = full_tensor(sd[table.mch_key_prefix + "_mch_sorted_raw_ids"])
    slots = full_tensor(sd[table.mch_key_prefix + "_mch_remapped_ids_mapping"])
    if weight is None or raw is None or slots is None:
        return None
    return _zch_rows(weight, raw, slots, model.world_size)


def _zch_rows(
    weight: torch.Tensor, raw: torch.Tensor, slots: torch.Tensor, world_size: int
) -> tuple[np.ndarray, np.ndarray]:
    per_shard = raw.numel() // world_size
    miss = torch.arange(world_size) * per_shard + per_shard - 1
    raw_s = raw.view(world_size, per_shard)[:, :-1]
    slots_s = slots.view(world_size, per_shard)[:, :-1]
    held = (raw_s != _EMPTY) & (slots_s != miss.unsqueeze(1))
    keys, rows = raw_s[held], slots_s[held]
    order = torch.argsort(keys)
    keys = torch.cat([torch.tensor([-1]), keys[order]])
    rows = torch.cat([miss[:1], rows[order]])
    return keys.numpy().astype(np.int64), weight[rows].float().numpy()


def write_table(path: str, keys: np.ndarray, rows: np.ndarray) -> None:
    """Write ``key`` int64 + ``embedding`` fixed-size list<float32> to ``path`` atomically."""
    dim = rows.shape[1]
    flat = pa.array(np.ascontiguousarray(rows, dtype=np.float32).reshape(-1), type=pa.float32())
    table = pa.table(
        {
            "key": pa.array(keys, type=pa.int64()),
            "embedding": pa.FixedSizeListArray.from_arrays(flat, dim),
        }
    )
    tmp = f"{path}.tmp-{os.getpid()}"
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def export_tables(model: ShardedModel, out_dir: str) -> dict[str, int]:
    """Write every table of ``model`` to ``<out_dir>/<table id>.parquet``; collective.

    Rank 0 writes all files. Returns ``{table id: rows written}`` on rank 0, ``{}`` elsewhere.
    """
    rank = dist.get_rank()
    if rank == 0:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    written: dict[str, int] = {}
    state = model.dmp.state_dict()
    for table in model.tables:
        got = table_rows(model, table, state)
        if got is not None:
            keys, rows = got
            write_table(str(Path(out_dir) / f"{table.table_id}.parquet"), keys, rows)
            written[table.table_id] = int(keys.shape[0])
    dist.barrier()
    return written
