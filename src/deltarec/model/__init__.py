"""The example recommendation model: a DLRM-style click model, its data and its sharding.

Exports: :class:`ModelConfig`, :class:`TableConfig`, :class:`ZchConfig`, :class:`DataConfig`,
:func:`tiny_model_config` (configuration; pydantic only), :class:`ClickModel`,
:class:`SparseArch` (unsharded modules), :class:`ClickStream`, :class:`Batch` (synthetic Zipf
click stream), :func:`build_sharded_model`, :class:`ShardedModel`, :func:`local_mch_modules`
(DMP + optimizers), :class:`TableInfo`, :func:`model_tables` (table ids and shapes).
Table ids: ``sparse.ebc.{user_id,item_id,category,query,geo}``, ``sparse.ec.history``,
``sparse.zch.ad_id``.

The configuration classes and the table list import only pydantic; everything else imports
torchrec and is loaded on first use, so validating a configuration (e.g. in ``deltarec
train`` before it starts torchrun) stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltarec._lazy import lazy_exports
from deltarec.model.config import (
    HISTORY,
    ZCH_TABLE,
    DataConfig,
    ModelConfig,
    TableConfig,
    ZchConfig,
    tiny_model_config,
)
from deltarec.model.tables import TableInfo, model_tables

if TYPE_CHECKING:
    from deltarec.model.click_model import ClickModel, SparseArch
    from deltarec.model.data import EVAL_STREAM, TRAIN_STREAM, Batch, ClickStream
    from deltarec.model.sharding import ShardedModel, build_sharded_model, local_mch_modules

_LAZY = {
    "ClickModel": "deltarec.model.click_model",
    "SparseArch": "deltarec.model.click_model",
    "EVAL_STREAM": "deltarec.model.data",
    "TRAIN_STREAM": "deltarec.model.data",
    "Batch": "deltarec.model.data",
    "ClickStream": "deltarec.model.data",
    "ShardedModel": "deltarec.model.sharding",
    "build_sharded_model": "deltarec.model.sharding",
    "local_mch_modules": "deltarec.model.sharding",
}

__all__ = [
    "EVAL_STREAM",
    "HISTORY",
    "TRAIN_STREAM",
    "ZCH_TABLE",
    "Batch",
    "ClickModel",
    "ClickStream",
    "DataConfig",
    "ModelConfig",
    "ShardedModel",
    "SparseArch",
    "TableConfig",
    "TableInfo",
    "ZchConfig",
    "build_sharded_model",
    "local_mch_modules",
    "model_tables",
    "tiny_model_config",
]


__getattr__ = lazy_exports(__name__, _LAZY)
