"""The example model's tables as deltarec sees them: table id, kind, dim, rows, sharding."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from deltarec.artifacts.types import DType, TableKind, TableSpec
from deltarec.ids import table_id
from deltarec.model.config import HISTORY, ZCH_TABLE, ModelConfig, TableConfig


@dataclass(frozen=True)
class TableInfo:
    """One table of the example model.

    Attributes:
        table_id: SPEC §3 table id, e.g. ``sparse.ebc.user_id``.
        name: the torchrec table name.
        module: the owning module's FQN (``sparse.ebc``, ``sparse.ec``, ``sparse.zch``).
        kind: ``plain`` or ``zch``.
        dim: embedding dimension.
        num_embeddings: rows of the table (for ZCH: slots over all ranks).
        sharding: the sharding type name (``table_wise``, ``row_wise``, ...).
        weight_key: the weight's key in ``dmp.state_dict()``.
        zch_size: ZCH slots over all ranks (None for plain tables).
    """

    table_id: str
    name: str
    module: str
    kind: str
    dim: int
    num_embeddings: int
    sharding: str
    weight_key: str
    zch_size: int | None = None

    @property
    def mch_key_prefix(self) -> str:
        """Prefix of this ZCH table's MCH buffers in ``dmp.state_dict()`` (ZCH only)."""
        return (
            f"{self.module}._managed_collision_collection._managed_collision_modules.{self.name}."
        )


def _plain_table(module: str, name: str, t: TableConfig, weights: str) -> TableInfo:
    """A plain table of ``module``; its weight is ``<module>.<weights>.<name>.weight``."""
    return TableInfo(
        table_id=table_id(module, name),
        name=name,
        module=module,
        kind="plain",
        dim=t.dim,
        num_embeddings=t.num_embeddings,
        sharding=t.sharding,
        weight_key=f"{module}.{weights}.{name}.weight",
    )


def model_tables(config: ModelConfig, world_size: int) -> list[TableInfo]:
    """Every table of the example model for ``world_size`` ranks, in a fixed order."""
    out = [_plain_table("sparse.ebc", n, t, "embedding_bags") for n, t in config.tables.items()]
    out.append(_plain_table("sparse.ec", HISTORY, config.history, "embeddings"))
    z = config.zch
    slots = z.zch_size_per_rank * world_size
    out.append(
        TableInfo(
            table_id=table_id("sparse.zch", ZCH_TABLE),
            name=ZCH_TABLE,
            module="sparse.zch",
            kind="zch",
            dim=z.dim,
            num_embeddings=slots,
            sharding="row_wise",
            weight_key=f"sparse.zch._embedding_module.embedding_bags.{ZCH_TABLE}.weight",
            zch_size=slots,
        )
    )
    return out


def declared_tables(
    config: ModelConfig,
    world_size: int,
    *,
    default_dtype: DType | None = None,
    dtypes: Mapping[str, DType] | None = None,
) -> dict[str, TableSpec]:
    """The example model's tables for these settings, as the specs its dumps will declare.

    Args:
        config: the model's configuration.
        world_size: ranks over all nodes (a ZCH table has slots per rank).
        default_dtype: the row encoding of tables not in ``dtypes`` (None: float32).
        dtypes: table id -> row encoding.
    """
    dtypes = dtypes or {}
    return {
        t.table_id: TableSpec(
            dim=t.dim,
            dtype=dtypes.get(t.table_id, default_dtype or DType.FLOAT32),
            kind=TableKind(t.kind),
            num_embeddings=t.num_embeddings,
            zch_size=t.zch_size,
            sharding=t.sharding,
            module_type=(
                "EmbeddingBagCollection"
                if ".embedding_bags." in t.weight_key
                else "EmbeddingCollection"
            ),
        )
        for t in model_tables(config, world_size)
    }
