"""The example recommendation model: a DLRM-style click model, its data and its sharding.

Exports: :class:`ModelConfig`, :class:`TableConfig`, :class:`ZchConfig` (configuration),
:class:`ClickModel` (unsharded module), :class:`ClickStream`, :class:`Batch`,
:class:`DataConfig` (synthetic Zipf click stream), :func:`build_sharded_model`,
:class:`ShardedModel` (DMP + optimizers), :class:`TableInfo`, :func:`model_tables`
(table ids and shapes). Table ids: ``sparse.ebc.{user_id,item_id,category,query,geo}``,
``sparse.ec.history``, ``sparse.zch.ad_id``.
"""

from deltarec.model.click_model import HISTORY, ZCH_TABLE, ClickModel, SparseArch
from deltarec.model.config import ModelConfig, TableConfig, ZchConfig, tiny_model_config
from deltarec.model.data import EVAL_STREAM, TRAIN_STREAM, Batch, ClickStream, DataConfig
from deltarec.model.sharding import ShardedModel, build_sharded_model, local_mch_modules
from deltarec.model.tables import TableInfo, model_tables

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
