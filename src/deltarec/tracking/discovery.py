"""Find the tracked tables of a ``DistributedModelParallel`` model and build their sources.

Every sharded EmbeddingBagCollection / EmbeddingCollection of the model contributes one
source per table, in the same order on every rank (module FQN, then table name), whether or
not this rank holds rows of it. Tables of managed-collision (ZCH) modules are left to
:func:`deltarec.tracking.zch.discover_zch_sources`, whose sources are appended when that
module is available.

Touched rows come from torchrec's delta tracker, created here with
``dmp.init_torchrec_delta_tracker(DeltaTrackerConfig(tracking_mode=ID_ONLY,
delete_on_read=True))`` (or reused if the model already has one).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from deltarec.artifacts.types import TableKind, TableSpec
from deltarec.errors import ConfigError
from deltarec.ids import table_id as make_table_id
from deltarec.tracking.plain import (
    ColumnShard,
    ColumnShardSource,
    ReplicatedSource,
    RowShardSource,
)
from deltarec.tracking.tracker import TrackerHub
from deltarec.tracking.types import TableSource

log = logging.getLogger(__name__)

_TRACKER_PREFIXES = ("_dmp_wrapped_module.module.", "module.")
_ROW_SHARDED = {"table_wise", "row_wise", "table_row_wise"}


def _tracker_fqn(module_fqn: str) -> str:
    # The same cleaning torchrec's ModelDeltaTrackerTrec applies to the FQNs it reports.
    for prefix in _TRACKER_PREFIXES:
        if module_fqn.startswith(prefix):
            return module_fqn[len(prefix) :]
    return module_fqn


def _zch_hooks() -> tuple[
    Callable[[nn.Module], list[TableSource]], Callable[[nn.Module], set[str]]
]:
    try:
        zch = importlib.import_module("deltarec.tracking.zch")
    except ModuleNotFoundError as e:
        if e.name != "deltarec.tracking.zch":
            raise

        def _no_sources(model: nn.Module) -> list[TableSource]:
            return []

        def _no_fqns(model: nn.Module) -> set[str]:
            return set()

        return _no_sources, _no_fqns
    return zch.discover_zch_sources, zch.zch_embedding_fqns


def _sharded_modules(model: nn.Module) -> list[tuple[str, Any, str]]:
    """``(module fqn, module, attribute holding the tables)`` of plain sharded modules."""
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    inside_mc: set[int] = set()
    for _, mod in model.named_modules():
        if "ManagedCollision" in type(mod).__name__:
            inside_mc.update(id(m) for m in mod.modules() if m is not mod)
    found: list[tuple[str, Any, str]] = []
    for fqn, mod in model.named_modules():
        if id(mod) in inside_mc:
            continue
        if isinstance(mod, ShardedEmbeddingBagCollection):
            found.append((fqn, mod, "embedding_bags"))
        elif isinstance(mod, ShardedEmbeddingCollection):
            found.append((fqn, mod, "embeddings"))
    return sorted(found, key=lambda x: x[0])


def init_tracker(model: nn.Module) -> Any:
    """The model's torchrec delta tracker (ID_ONLY, delete_on_read), created if needed."""
    from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode

    init = getattr(model, "init_torchrec_delta_tracker", None)
    if init is None:
        raise ConfigError(
            f"model of type {type(model).__name__} is not a torchrec DistributedModelParallel; "
            "the dumper tracks touched rows through DMP's delta tracker"
        )
    config = DeltaTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, delete_on_read=True)
    try:
        return init(config)
    except AttributeError as e:
        # torchrec 1.8's tracker reads ``model.module`` of DMP's wrapped module, which only
        # exists when DMP wrapped dense parameters in DistributedDataParallel.
        raise ConfigError(
            "torchrec's delta tracker could not attach to this DistributedModelParallel model "
            f"({e}); torchrec 1.8 needs the model to have dense (non-embedding) parameters"
        ) from e


def discover_plain_sources(
    model: nn.Module, skip_fqns: set[str] | None = None
) -> list[TableSource]:
    """One source per plain table of a DMP model, in the same order on every rank.

    Args:
        model: a ``DistributedModelParallel``.
        skip_fqns: embedding FQNs (tracker form, or table ids) to leave out (ZCH tables).

    Raises:
        ConfigError: if the model is not a DMP model, a table's layout is not supported, or
            two tables share a feature name (the tracker could not tell their lookups apart).
    """
    skip = set(skip_fqns or ())
    modules = _sharded_modules(model)
    plans: list[tuple[str, str, Any, Any, str]] = []
    for fqn, mod, attr in modules:
        for name in sorted(mod._table_name_to_config):
            emb_fqn = f"{_tracker_fqn(fqn)}.{attr}.{name}"
            tid = make_table_id(fqn, name)
            if emb_fqn in skip or tid in skip:
                continue
            plans.append((fqn, name, mod, attr, emb_fqn))
    if not plans:
        return []
    _check_feature_names(modules)
    tracker = init_tracker(model)
    hub = TrackerHub(tracker, {p[4] for p in plans})
    state = {id(m): m.state_dict() for _, m, _ in modules}
    sources: list[TableSource] = []
    for fqn, name, mod, attr, emb_fqn in plans:
        sources.append(_source(fqn, name, mod, attr, emb_fqn, hub, state[id(mod)]))
    return sources


def _check_feature_names(modules: list[tuple[str, Any, str]]) -> None:
    owner: dict[str, str] = {}
    for fqn, mod, _ in modules:
        for name, cfg in mod._table_name_to_config.items():
            for feature in cfg.feature_names:
                where = f"{fqn}.{name}"
                if feature in owner and owner[feature] != where:
                    raise ConfigError(
                        f"feature {feature!r} feeds both {owner[feature]} and {where}: torchrec's "
                        "delta tracker keys lookups by feature name, so touched rows could not "
                        "be attributed; rename one feature"
                    )
                owner[feature] = where


def _source(
    fqn: str,
    name: str,
    mod: Any,
    attr: str,
    emb_fqn: str,
    hub: TrackerHub,
    state: dict[str, Any],
) -> TableSource:
    cfg = mod._table_name_to_config[name]
    param = mod.module_sharding_plan[name]
    sharding = str(param.sharding_type)
    tid = make_table_id(fqn, name)
    spec = TableSpec(
        dim=int(cfg.embedding_dim),
        kind=TableKind.PLAIN,
        num_embeddings=int(cfg.num_embeddings),
        zch_size=None,
        sharding=sharding,
    )
    value = state.get(f"{attr}.{name}.weight")
    if value is None:
        raise ConfigError(f"table {tid}: no weight {attr}.{name}.weight in the module state")
    if sharding == "data_parallel":
        return ReplicatedSource(tid, spec, hub, emb_fqn, _dense(value, tid))
    shards = list(value.local_shards())
    if sharding in _ROW_SHARDED:
        if len(shards) > 1:
            raise ConfigError(
                f"table {tid}: {len(shards)} row shards on one rank are not supported"
            )
        if not shards:
            return RowShardSource(tid, spec, hub, emb_fqn, None, 0)
        shard = shards[0]
        rows_off, col_off = (int(x) for x in shard.metadata.shard_offsets)
        if col_off != 0 or shard.tensor.shape[1] != spec.dim:
            raise ConfigError(f"table {tid}: {sharding} shard does not hold whole rows")
        return RowShardSource(tid, spec, hub, emb_fqn, shard.tensor.detach(), rows_off)
    if sharding == "column_wise":
        cols = [
            ColumnShard(int(s.metadata.shard_offsets[1]), s.tensor.detach())
            for s in shards
            if int(s.metadata.shard_offsets[0]) == 0
        ]
        writer = _writer_rank(param, tid)
        return ColumnShardSource(tid, spec, hub, emb_fqn, cols, writer)
    raise ConfigError(f"table {tid}: sharding type {sharding!r} is not supported by the dumper")


def _dense(value: Any, tid: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor) and not hasattr(value, "local_shards"):
        return value.detach()
    raise ConfigError(f"table {tid}: data-parallel weight is not a plain tensor")


def _writer_rank(param: Any, tid: str) -> int:
    spec = getattr(param, "sharding_spec", None)
    shards = getattr(spec, "shards", None)
    if not shards:
        raise ConfigError(f"table {tid}: column-wise sharding without a sharding spec")
    first = min(shards, key=lambda s: (s.shard_offsets[1], s.placement.rank()))
    return int(first.placement.rank())


def discover_sources(model: nn.Module) -> list[TableSource]:
    """Every tracked table of ``model``: plain tables, then ZCH tables (if supported here)."""
    discover_zch, zch_fqns = _zch_hooks()
    skip = set(zch_fqns(model))
    sources = discover_plain_sources(model, skip)
    sources.extend(discover_zch(model))
    return sources
