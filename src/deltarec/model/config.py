"""Configuration of the example click model and its sharding (pydantic, unknown keys rejected).

The model's tables and their table ids (SPEC §3: owning module FQN + ``.`` + table name):

============================  ==================  ===========================  =============
table id                      module              sharding                     kind
============================  ==================  ===========================  =============
``sparse.ebc.user_id``        EmbeddingBagColl.   table-wise (rank 0)          plain
``sparse.ebc.item_id``        EmbeddingBagColl.   row-wise                     plain
``sparse.ebc.category``       EmbeddingBagColl.   data-parallel                plain
``sparse.ebc.query``          EmbeddingBagColl.   column-wise (one column      plain
                                                  shard per rank)
``sparse.ebc.geo``            EmbeddingBagColl.   table-row-wise (host 0)      plain
``sparse.ec.history``         EmbeddingCollection row-wise                     plain
``sparse.zch.ad_id``          ManagedCollision-   row-wise (the only sharding  zch
                              EmbeddingBagColl.   torchrec allows for MC)
============================  ==================  ===========================  =============
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

HISTORY = "history"
"""Name of the EmbeddingCollection's sequence table (and feature)."""
ZCH_TABLE = "ad_id"
"""Name of the managed-collision table (and feature)."""

ShardingName = Literal["table_wise", "row_wise", "column_wise", "data_parallel", "table_row_wise"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class TableConfig(_Strict):
    """One plain embedding table."""

    num_embeddings: int = Field(gt=0)
    """Rows of the table (ids are ``[0, num_embeddings)``)."""
    dim: int = Field(ge=16, le=64)
    """Embedding dimension."""
    sharding: ShardingName
    """How the table is sharded across ranks."""
    ids_per_sample: int = Field(default=1, ge=1)
    """Ids of this feature per sample (pooled by the bag; for ``history`` the maximum length)."""
    zipf_a: float = Field(default=1.1, gt=1.0)
    """Zipf exponent of the synthetic ids (larger: more skewed)."""


class ZchConfig(_Strict):
    """The managed-collision (ZCH) table ``sparse.zch.ad_id``."""

    zch_size_per_rank: int = Field(default=256, ge=8)
    """Slots per rank; the table has ``zch_size_per_rank * world_size`` rows. One slot per
    rank is the shared miss (fallback) slot, so each rank holds ``zch_size_per_rank - 1`` ids."""
    dim: int = Field(default=32, ge=16, le=64)
    """Embedding dimension."""
    raw_id_space: int = Field(default=1_000_000, gt=0)
    """Raw ids are ``[0, raw_id_space)``; this is MCH's ``input_hash_size`` so ids are routed to
    rank ``id // (raw_id_space / world_size)``."""
    eviction_policy: Literal["lfu", "lru"] = "lfu"
    """``lfu`` (DistanceLFU) or ``lru``."""
    eviction_interval: int = Field(default=20, ge=1)
    """Training steps between MCH admission/eviction rounds."""
    ids_per_sample: int = Field(default=1, ge=1)
    """Ad ids per sample."""
    zipf_a: float = Field(default=1.05, gt=1.0)
    """Zipf exponent of the raw ids."""
    drift_every: int = Field(default=50, ge=1)
    """Every this many steps the popular raw ids move, so admissions and evictions keep
    happening (a stable hot set would fill the table once and then rarely change)."""


class DataConfig(_Strict):
    """The synthetic stream's length per rank (unknown keys rejected)."""

    batches_per_rank: int | None = Field(default=None, ge=0)
    """Training batches each rank has (None: endless)."""
    batches_by_rank: dict[int, int] = Field(default_factory=dict)
    """Per-rank override of ``batches_per_rank`` (tests of uneven exhaustion)."""

    def length_for(self, rank: int) -> int | None:
        """Number of training batches rank ``rank`` has (None: endless)."""
        return self.batches_by_rank.get(rank, self.batches_per_rank)


def _default_tables() -> dict[str, TableConfig]:
    return {
        "user_id": TableConfig(num_embeddings=4000, dim=32, sharding="table_wise"),
        "item_id": TableConfig(num_embeddings=5000, dim=32, sharding="row_wise"),
        "category": TableConfig(num_embeddings=200, dim=16, sharding="data_parallel"),
        "query": TableConfig(num_embeddings=2000, dim=32, sharding="column_wise", ids_per_sample=3),
        "geo": TableConfig(num_embeddings=1000, dim=16, sharding="table_row_wise"),
    }


class ModelConfig(_Strict):
    """The example DLRM-style click model.

    ``tables`` are the EmbeddingBagCollection's tables (names are the torchrec table names and
    feature names). The sequence table ``history`` (EmbeddingCollection) and the ZCH table
    ``ad_id`` are configured by ``history`` and ``zch``.
    """

    tables: dict[str, TableConfig] = Field(default_factory=_default_tables)
    """EmbeddingBagCollection tables by name."""
    history: TableConfig = TableConfig(
        num_embeddings=5000, dim=16, sharding="row_wise", ids_per_sample=5
    )
    """The EmbeddingCollection's sequence table ``history`` (``ids_per_sample`` = max length)."""
    zch: ZchConfig = ZchConfig()
    """The managed-collision table."""
    dense_features: int = Field(default=8, ge=1)
    """Dense (float) input features per sample."""
    hidden: int = Field(default=64, ge=4)
    """Width of the MLP layers."""
    embedding_lr: float = Field(default=0.05, gt=0)
    """Learning rate of the fused embedding optimizers (RowWiseAdagrad; ``zch_optimizer``)."""
    dense_lr: float = Field(default=0.01, gt=0)
    """Learning rate of the dense optimizer (Adagrad), also for data-parallel tables."""
    zch_optimizer: Literal["adagrad", "sgd", "rowwise_adagrad"] = "adagrad"
    """Fused optimizer of the ZCH table. For ``rowwise_adagrad`` on CPU, ``build_sharded_model``
    installs :func:`deltarec.tracking.zch.cpu.install_cpu_eviction_reset` (fbgemm's
    ``reset_weight_momentum``, called at each MCH admission, has no CPU kernel)."""

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        reserved = {"history", "ad_id"} & set(self.tables)
        if reserved:
            raise ValueError(f"table names {sorted(reserved)} are reserved for history/zch")
        if self.history.sharding not in ("table_wise", "row_wise"):
            raise ValueError(
                f"history (EmbeddingCollection) sharding {self.history.sharding!r}: only "
                "table_wise or row_wise are supported for the sequence table"
            )
        for name, t in self.tables.items():
            if t.sharding == "column_wise" and t.dim % 2:
                raise ValueError(f"table {name!r}: column_wise needs an even dim, got {t.dim}")
        return self


def tiny_model_config(**overrides: object) -> ModelConfig:
    """A small model for tests: a few hundred rows per table, 32 ZCH slots per rank.

    The ZCH table admits and evicts every 5 steps and its popular raw ids move every 20
    steps, so a test of a few dozen steps sees admissions and evictions. ``overrides`` replace
    top-level :class:`ModelConfig` fields.
    """

    def t(rows: int, dim: int, sharding: ShardingName, ids: int = 1) -> TableConfig:
        return TableConfig(num_embeddings=rows, dim=dim, sharding=sharding, ids_per_sample=ids)

    fields: dict[str, object] = {
        "tables": {
            "user_id": t(300, 16, "table_wise"),
            "item_id": t(400, 16, "row_wise"),
            "category": t(50, 16, "data_parallel"),
            "query": t(200, 32, "column_wise", 2),
            "geo": t(100, 16, "table_row_wise"),
        },
        "history": t(400, 16, "row_wise", 4),
        "zch": ZchConfig(
            zch_size_per_rank=32, dim=16, raw_id_space=100_000, eviction_interval=5, drift_every=20
        ),
        "hidden": 16,
        **overrides,
    }
    return ModelConfig.model_validate(fields)
