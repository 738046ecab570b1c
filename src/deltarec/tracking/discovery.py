"""Find the tracked tables of a ``DistributedModelParallel`` model and build their sources.

Every sharded EmbeddingBagCollection / EmbeddingCollection of the model contributes one
source per table, in the same order on every rank (module FQN, then table name), whether or
not this rank holds rows of it. Tables of managed-collision (ZCH) modules are left to
:func:`deltarec.tracking.zch.discover_zch_sources`, whose sources are appended when that
module is available.

Touched rows come from torchrec's delta tracker, created here with
``dmp.init_torchrec_delta_tracker(DeltaTrackerConfig(tracking_mode=ID_ONLY,
delete_on_read=True))`` (or reused if the model already has one), for every module whose
lookups it files under their own tables' paths; deltarec records the other modules' lookups
itself (:mod:`deltarec.tracking.lookups`). The check runs here, before the first step.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deltarec.artifacts.types import TableKind, TableSpec
from deltarec.errors import ConfigError
from deltarec.ids import table_id as make_table_id
from deltarec.tracking.errors import TrackingError
from deltarec.tracking.lookups import LookupRecorder
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
_COLUMN_SHARDED = {"column_wise", "table_column_wise"}


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
    """The model's torchrec delta tracker (ID_ONLY, delete_on_read), created if needed.

    Returns None when torchrec's tracker cannot attach to this model (torchrec 1.8's tracker
    needs dense, non-embedding parameters); every table is then recorded by deltarec.

    Raises:
        ConfigError: if ``model`` is not a ``DistributedModelParallel``.
    """
    from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode

    init = getattr(model, "init_torchrec_delta_tracker", None)
    if init is None:
        raise ConfigError(
            f"model of type {type(model).__name__} is not a torchrec DistributedModelParallel; "
            "the dumper tracks touched rows of its sharded embedding modules"
        )
    config = DeltaTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, delete_on_read=True)
    try:
        return init(config)
    except AttributeError as e:
        # torchrec 1.8's tracker reads ``model.module`` of DMP's wrapped module, which only
        # exists when DMP wrapped dense parameters in DistributedDataParallel.
        log.info("torchrec's delta tracker cannot attach (%s); deltarec records every lookup", e)
        return None


@dataclass
class _Table:
    module_fqn: str
    name: str
    module: Any
    attr: str
    path: str
    table_id: str


def discover_plain_sources(
    model: nn.Module, skip_fqns: set[str] | None = None
) -> list[TableSource]:
    """One source per plain table of a DMP model, in the same order on every rank.

    Each table's touched rows come from torchrec's delta tracker when it files every lookup
    of the table's module under that table's own path, checked here against the tracker's
    maps (``feature_to_fqn``) before the first step. Any other module (a table name used in
    two modules, a feature feeding tables of two modules, a table and a module of the same
    name) is recorded by deltarec itself (:class:`~deltarec.tracking.lookups.LookupRecorder`)
    and torchrec's tracker is detached from it, so it can neither crash on nor misfile its
    lookups.

    Args:
        model: a ``DistributedModelParallel``.
        skip_fqns: embedding FQNs (tracker form, or table ids) to leave out (ZCH tables).

    Raises:
        ConfigError: if the model is not a DMP model or a table's layout is not supported.
        TrackingError: if a module's lookups can be attributed neither by torchrec's tracker
            nor by deltarec's recorder.
    """
    skip = set(skip_fqns or ())
    modules = _sharded_modules(model)
    tables: list[_Table] = []
    for fqn, mod, attr in modules:
        for name in sorted(mod._table_name_to_config):
            path = f"{_tracker_fqn(fqn)}.{attr}.{name}"
            tid = make_table_id(fqn, name)
            if path in skip or tid in skip:
                continue
            tables.append(_Table(fqn, name, mod, attr, path, tid))
    if not tables:
        return []
    tracker = init_tracker(model)
    by_module: dict[str, list[_Table]] = {}
    for t in tables:
        by_module.setdefault(t.module_fqn, []).append(t)
    state = {id(m): m.state_dict() for _, m, _ in modules}
    recorders = []
    by_torchrec: list[list[_Table]] = []
    by_deltarec: list[list[_Table]] = []
    try:
        for group in by_module.values():
            why = _not_attributed(tracker, group)
            if why is None:
                by_torchrec.append(group)
                continue
            tids = [t.table_id for t in group]
            log.info("deltarec records the lookups of %s itself: %s", tids, why)
            recorders.append(_own_recorder(tracker, group, state[id(group[0].module)]))
            by_deltarec.append(group)
    except BaseException:
        for recorder in recorders:
            recorder.close()
        raise
    hub = TrackerHub(
        tracker,
        {t.path for t in tables},
        recorders=recorders,
        tracker_fqns={t.path for group in by_torchrec for t in group},
        ignored=skip,
        explain=_explainer(tracker, tables),
        checks=[_hooks_unchanged(tracker, by_torchrec, by_deltarec)],
    )
    return [
        _source(t.module_fqn, t.name, t.module, t.attr, t.path, hub, state[id(t.module)])
        for t in tables
    ]


def _not_attributed(tracker: Any, group: list[_Table]) -> str | None:
    """Why torchrec's tracker would not file every lookup of this module right (None: it would)."""
    if tracker is None:
        return "torchrec's delta tracker cannot attach to this model"
    mod = group[0].module
    record = getattr(tracker, "record_lookup", None)
    if record is None or getattr(mod, "post_lookup_tracker_fn", None) != record:
        return "torchrec's delta tracker does not record this module's lookups"
    feature_to_fqn = getattr(tracker, "feature_to_fqn", {})
    for t in group:
        for feature in t.module._table_name_to_config[t.name].feature_names:
            filed = feature_to_fqn.get(feature)
            if filed != t.path:
                return (
                    f"torchrec's delta tracker would file feature {feature!r} of table "
                    f"{t.table_id} under {filed!r}, not under the table's path {t.path!r} "
                    "(it maps tables by name and features by name over the whole model)"
                )
    return None


def _own_recorder(tracker: Any, group: list[_Table], state: dict[str, Any]) -> LookupRecorder:
    """Build deltarec's recorder for one module (torchrec's tracker detached from it).

    Raises:
        TrackingError: a table this rank holds rows of is looked up by none of the module's
            embedding kernels here, so its lookups could not be recorded.
    """
    mod = group[0].module
    if tracker is not None and getattr(mod, "post_lookup_tracker_fn", None) == getattr(
        tracker, "record_lookup", None
    ):
        # torchrec's tracker would crash on (KeyError) or misfile this module's lookups.
        mod.post_lookup_tracker_fn = None
    paths = {t.name: t.path for t in group}
    table_ids = {t.name: t.table_id for t in group}
    for name in mod._table_name_to_config:
        paths.setdefault(name, f"{group[0].path.rsplit('.', 1)[0]}.{name}")
        table_ids.setdefault(name, make_table_id(group[0].module_fqn, name))
    recorder = LookupRecorder(mod, paths, table_ids)
    unseen = [
        t.table_id
        for t in group
        if t.name not in recorder.tables_seen
        and _holds_rows(state.get(f"{t.attr}.{t.name}.weight"))
    ]
    if unseen:
        recorder.close()
        raise TrackingError(
            unseen,
            (),
            "this rank holds rows of the table, but none of its module's embedding kernels "
            "looks it up, so its lookups could not be recorded (an unsupported torchrec "
            "lookup layout)",
        )
    return recorder


def _holds_rows(value: Any) -> bool:
    """Whether this rank holds rows of a table weight (a ShardedTensor or a replica)."""
    if value is None:
        return False
    if hasattr(value, "local_shards"):
        return any(s.tensor.numel() > 0 for s in value.local_shards())
    return bool(value.numel() > 0)


def _hooks_unchanged(
    tracker: Any, by_torchrec: list[list[_Table]], by_deltarec: list[list[_Table]]
) -> Callable[[], None]:
    """A check, run at every dump, that each module is still recorded the way it was set up.

    A post-lookup hook replaced after the dumper started would silently stop torchrec's
    tracker from recording a module; torchrec's tracker attached again to a module deltarec
    records would misfile its lookups (or crash on them).
    """
    record = getattr(tracker, "record_lookup", None) if tracker is not None else None

    def check() -> None:
        for group in by_torchrec:
            if getattr(group[0].module, "post_lookup_tracker_fn", None) != record:
                raise TrackingError(
                    [t.table_id for t in group],
                    (),
                    "the module's post-lookup hook was replaced after the dumper started, so "
                    "torchrec's delta tracker no longer records its lookups and touched rows "
                    "would be missed; register other post-lookup functions before on_start",
                )
        for group in by_deltarec:
            hook = getattr(group[0].module, "post_lookup_tracker_fn", None)
            if record is not None and hook == record:
                raise TrackingError(
                    [t.table_id for t in group],
                    (),
                    "torchrec's delta tracker was attached again to the module after the "
                    "dumper started; it cannot attribute this module's lookups (deltarec "
                    "records them), so it would misfile them",
                )

    return check


def _explainer(tracker: Any, tables: list[_Table]) -> Callable[[str], list[str]]:
    """Map a path to the table ids whose features torchrec's tracker files under that path."""
    features = {
        t.table_id: list(t.module._table_name_to_config[t.name].feature_names) for t in tables
    }

    def explain(path: str) -> list[str]:
        filed = getattr(tracker, "feature_to_fqn", {})
        return sorted(tid for tid, fs in features.items() if any(filed.get(f) == path for f in fs))

    return explain


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
        module_type="EmbeddingBagCollection" if attr == "embedding_bags" else "EmbeddingCollection",
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
    if sharding in _COLUMN_SHARDED:
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
        raise ConfigError(f"table {tid}: {param.sharding_type} sharding without a sharding spec")
    first = min(shards, key=lambda s: (s.shard_offsets[1], s.placement.rank()))
    return int(first.placement.rank())


def discover_sources(model: nn.Module) -> list[TableSource]:
    """Every tracked table of ``model``: plain tables, then ZCH tables (if supported here)."""
    discover_zch, zch_fqns = _zch_hooks()
    skip = set(zch_fqns(model))
    sources = discover_plain_sources(model, skip)
    sources.extend(discover_zch(model))
    return sources
