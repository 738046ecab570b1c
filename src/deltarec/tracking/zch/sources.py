"""ZCH (managed-collision) tables as dump sources: raw ids, admissions, evictions, key ``-1``.

A ZCH table is an embedding table behind torchrec's ``MCHManagedCollisionModule``: raw feature
ids are mapped to slots (rows) of a table of ``zch_size`` rows; ids are admitted and evicted
as training goes; ids that are not held share the last slot (the fallback or miss row).
Serving looks rows up by raw id, so these sources speak raw ids (SPEC §3, §4):

* key = the raw feature id (as the module holds it, i.e. after its ``input_hash_func`` if it
  has one), ``op = 0``, the id's current row: for every id looked up in training, or admitted,
  since the previous collect (an admitted id is dumped even if it was not looked up after
  admission; an id evicted and re-admitted is dumped with its new row);
* key = a raw id evicted since the previous collect and not held now: ``op = 1`` with the
  fallback row read at collect time;
* with ``SourceOptions.zch_misses`` (``DumperConfig.zch_misses``): key = a raw id looked up in
  training since the previous collect that is not held now and was neither admitted nor
  evicted since (never admitted, or not yet): ``op = 1`` with the fallback row read at collect
  time, the row the model answers it with (TorchEasyRec publishes these ids so);
* key = ``-1``: the fallback row, at the first collect and whenever a lookup in training went
  to it since (rank 0 only when sharded: one row per key per dump across ranks). Empty slots
  are never dumped.

Every remapped row is checked against the local shard's row range, at each lookup (before the
embedding reads it) and before any row is read for a dump; a violation raises
:class:`ZchRowRangeError` naming the table and the rows. Work per collect is one sort of the k
recorded (looked-up, admitted, evicted) ids plus reading their rows: the mapping is not read,
and nothing scans it except :meth:`ZchTableSource.snapshot`.

Tracking installs instance-level wrappers on each MCH module (see
:mod:`deltarec.tracking.zch.recorder`); :meth:`ZchTableSource.close` removes them. No torchrec
class is patched.

Exports:
    discover_zch_sources(model) -> list[ZchTableSource]
    zch_embedding_fqns(model) -> set[str]
    ZchTableSource, ZchError, ZchRowRangeError, ZchTrackingError, ZchUnsupportedError,
    ZchKeyCollisionError.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from deltarec.artifacts.types import FALLBACK_KEY, DType, TableKind, TableSpec
from deltarec.ids import table_id
from deltarec.tracking.types import SourceOptions, TableSource, TouchedRows
from deltarec.tracking.zch.errors import (
    ZchError,
    ZchKeyCollisionError,
    ZchRowRangeError,
    ZchTrackingError,
    ZchUnsupportedError,
)
from deltarec.tracking.zch.recorder import EMPTY_ID, MchRecorder

__all__ = [
    "ZchError",
    "ZchKeyCollisionError",
    "ZchRowRangeError",
    "ZchTableSource",
    "ZchTrackingError",
    "ZchUnsupportedError",
    "discover_zch_sources",
    "zch_embedding_fqns",
]

_INT64_MAX = (1 << 63) - 1


@dataclass
class ZchPlacement:
    """Where one ZCH table's rows live on this rank (what sharding decides).

    Attributes:
        weight: returns this rank's embedding rows ``[local_rows, dim]`` (a live view).
        row_offset: the global row of local row 0.
        num_embeddings: the table's global row count (= its global zch_size).
        sharded: True for a DMP-sharded (row-wise) table.
        rank: this rank (0 when not distributed).
        world_size: the number of ranks sharing the table (1 when unsharded).
    """

    weight: Callable[[], torch.Tensor]
    row_offset: int
    num_embeddings: int
    sharded: bool
    rank: int
    world_size: int


@dataclass
class ZchTable(ZchPlacement):
    """Where one ZCH table's parts live on this rank (its rows: the :class:`ZchPlacement` fields).

    Attributes:
        table_id: the table id (owning module FQN without DMP prefixes + ``.`` + table name).
        module_fqn: the owning MC-EBC/MC-EC module's FQN in ``model.named_modules()``.
        table_name: the torchrec table name.
        mch: this rank's ``MCHManagedCollisionModule`` of the table.
        embedding_fqns: FQNs under which trackers may key the table's rows.
    """

    table_id: str
    module_fqn: str
    table_name: str
    mch: Any
    embedding_fqns: tuple[str, ...]


class ZchTableSource(TableSource):
    """One ZCH table's part on this rank, keyed by raw feature id (see the module docstring).

    Args:
        table: where the table lives (from :func:`find_zch_tables`).

    Raises:
        ZchTrackingError: if the table's MCH module is already tracked by an open source.
    """

    def __init__(self, table: ZchTable) -> None:
        self.table = table
        self.table_id = table.table_id
        weight = table.weight()
        local_rows = int(weight.shape[0])
        self._check_shard_matches(local_rows)
        self.spec = TableSpec(
            dim=int(weight.shape[1]),
            dtype=DType.FLOAT16 if weight.dtype == torch.float16 else DType.FLOAT32,
            kind=TableKind.ZCH,
            num_embeddings=table.num_embeddings,
            zch_size=table.num_embeddings,
            sharding="row_wise",
            module_type=(
                "EmbeddingBagCollection"
                if "._embedding_module.embedding_bags." in f".{table.embedding_fqns[0]}"
                else "EmbeddingCollection"
            ),
        )
        self._row_dtype = torch.float16 if weight.dtype == torch.float16 else torch.float32
        self.writes = _writes_rows(table)
        self.writes_fallback = self.writes and table.rank == 0
        self._fallback_pending = True
        self._recorder = MchRecorder(
            table.table_id, table.mch, table.row_offset, table.row_offset + local_rows
        )

    # ---- TableSource --------------------------------------------------------------------

    def collect(self) -> TouchedRows:
        """Rows of the raw ids touched, admitted or evicted since the previous collect, read now.

        Ids looked up only as misses are included (``op = 1``, fallback row) once
        :meth:`configure` turned ``zch_misses`` on.

        Raises:
            ZchRowRangeError: if the mapping holds a row outside this rank's shard.
            ZchKeyCollisionError: if raw id ``-1`` is held.
        """
        rec = self._recorder.take()
        with_fallback = self.writes_fallback and (rec.miss or self._fallback_pending)
        self._fallback_pending = False
        return self._rows_for(rec.ids, rec.rows, with_fallback)

    def snapshot(self, chunk_rows: int) -> Iterator[TouchedRows]:
        """Every held raw id of this rank's part with its row (plus key ``-1`` on rank 0).

        Scans the whole mapping (it is the snapshot). Chunks hold at most ``chunk_rows`` rows.
        """
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
        sorted_ids = self.table.mch._mch_sorted_raw_ids[:-1]
        if self.writes_fallback:
            none = sorted_ids[:0]
            yield self._rows_for(none, none.clone(), with_fallback=True)
        positions = torch.nonzero(sorted_ids != EMPTY_ID).flatten()
        for start in range(0, int(positions.numel()), chunk_rows):
            pos = positions[start : start + chunk_rows]
            rows = self.table.mch._mch_remapped_ids_mapping[pos]
            yield self._rows_for(sorted_ids[pos], rows, with_fallback=False)

    def read_keys(self, keys: torch.Tensor) -> TouchedRows:
        """Current rows of the given raw ids that route to this rank (restore republish).

        Ids held come back with ``op = 0`` and their row; ids not held with ``op = 1`` and
        this rank's fallback row; key ``-1`` (rank 0 only) with the fallback row.
        """
        device = self.table.mch._mch_sorted_raw_ids.device
        keys = torch.unique(keys.to(device=device, dtype=torch.int64))
        want_fallback = self.writes_fallback and bool((keys == FALLBACK_KEY).any())
        keys = keys[(keys != FALLBACK_KEY) & self._owned(keys)]
        held, rows = self._lookup(keys)
        return self._rows_for(keys, torch.where(held, rows, -1), with_fallback=want_fallback)

    def close(self) -> None:
        """Remove the instance-level wrappers from the MCH module (idempotent)."""
        self._recorder.close()

    # ---- optional hooks the dumper calls ------------------------------------------------

    def configure(self, options: SourceOptions) -> None:
        """``options.zch_misses``: from now on also dump ids looked up as misses (op 1)."""
        self._recorder.keep_misses = bool(options.zch_misses)

    def before_eval(self) -> None:
        """Lookups from now on are evaluation: not recorded (mapping changes still are)."""
        self._recorder.paused = True

    def after_eval(self) -> None:
        """Evaluation ended: record training lookups again."""
        self._recorder.paused = False

    def discard(self) -> None:
        """Forget what was recorded so far (a generation starts from a snapshot or republish).

        The fallback row is still written at the next collect.
        """
        self._recorder.take()
        self._fallback_pending = True

    # ---- helpers ------------------------------------------------------------------------

    def _check_shard_matches(self, local_rows: int) -> None:
        mch = self.table.mch
        lo, size = int(mch._output_global_offset), int(mch._zch_size)
        if lo != self.table.row_offset or size != local_rows:
            raise ZchUnsupportedError(
                self.table_id,
                f"managed-collision shard rows [{lo}, {lo + size}) differ from the embedding "
                f"shard rows [{self.table.row_offset}, {self.table.row_offset + local_rows})",
            )

    def _lookup(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(held mask, global rows)`` of raw ids, by the module's own remap rule."""
        mch = self.table.mch
        sorted_ids = mch._mch_sorted_raw_ids
        pos = torch.searchsorted(sorted_ids[:-1], keys)
        held = (sorted_ids[pos] == keys) & (keys != EMPTY_ID)
        rows = mch._mch_remapped_ids_mapping[pos]
        return held, rows

    def _rows_for(self, keys: torch.Tensor, rows: torch.Tensor, with_fallback: bool) -> TouchedRows:
        """Read the rows now: ``rows >= 0`` → that row (op 0), ``-1`` → fallback row (op 1).

        ``rows`` (global rows, one per key) must be a tensor the caller owns: it is modified.
        """
        negative = keys.numel() > 0 and int(keys.min()) <= FALLBACK_KEY
        if negative and bool(((keys == FALLBACK_KEY) & (rows >= 0)).any()):
            raise ZchKeyCollisionError(self.table_id)
        miss = self._recorder.miss_slot
        if with_fallback:
            keys = torch.cat([keys.new_full((1,), FALLBACK_KEY), keys])
            rows = torch.cat([rows.new_full((1,), miss), rows])
        evicted = rows < 0
        ops = evicted.to(torch.int8)  # Op.UPSERT (0) where held, Op.EVICTED (1) elsewhere
        rows.masked_fill_(evicted, miss)
        self._recorder.check_rows(rows, "the rows read for a dump")
        weight = self.table.weight().detach()
        local = rows.sub_(self.table.row_offset).to(weight.device)
        values = weight.index_select(0, local)
        return TouchedRows(keys=keys, rows=values.to(self._row_dtype), ops=ops)

    def _owned(self, keys: torch.Tensor) -> torch.Tensor:
        """Mask of raw ids that the sharded input distribution routes to this rank."""
        t = self.table
        if not t.sharded or t.world_size == 1:
            return torch.ones_like(keys, dtype=torch.bool)
        buckets = int(t.mch.buckets())
        block = -(-int(t.mch.input_size()) // buckets)  # ceil, exact for 2**63 - 1
        bucket = torch.div(keys, block, rounding_mode="floor")
        if block * buckets <= _INT64_MAX:
            bucket = torch.where(keys < block * buckets, bucket, keys % buckets)
        per_rank = max(1, buckets // t.world_size)
        return (torch.div(bucket, per_rank, rounding_mode="floor") == t.rank) & (keys >= 0)


def _writes_rows(table: ZchTable) -> bool:
    """Sharded parts all write (their raw ids are disjoint); replicas write on rank 0 only."""
    if table.sharded:
        return True
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


# ---- discovery ----------------------------------------------------------------------------


def discover_zch_sources(model: torch.nn.Module) -> list[TableSource]:
    """One :class:`ZchTableSource` per ZCH table of ``model`` on this rank, tracking from now.

    Works on DMP-sharded models (``ManagedCollisionEmbeddingBagCollectionSharder`` /
    ``ManagedCollisionEmbeddingCollectionSharder``, row-wise) and on unsharded models with
    ``ManagedCollisionEmbeddingBagCollection`` / ``ManagedCollisionEmbeddingCollection``.
    Each source installs instance-level wrappers on its MCH module; call ``close()`` on every
    source to remove them.

    Raises:
        ZchUnsupportedError: a managed-collision table whose module is not an
            ``MCHManagedCollisionModule``, or whose shard layout is not understood.
        ZchTrackingError: a table is already tracked by another open source.
    """
    sources: list[TableSource] = []
    try:
        for table in find_zch_tables(model):
            sources.append(ZchTableSource(table))
    except BaseException:
        for source in sources:
            source.close()
        raise
    return sources


def zch_embedding_fqns(model: torch.nn.Module) -> set[str]:
    """FQNs of the ZCH tables' embedding modules, which the plain delta tracker must skip.

    For each ZCH table: ``<owner>._embedding_module.embedding_bags.<table>`` (or
    ``.embeddings.<table>`` for an MC-EC) and ``<owner>._managed_collision_collection.
    _managed_collision_modules.<table>`` (the key torchrec's ModelDeltaTracker may use), with
    DMP prefixes (``_dmp_wrapped_module.``, ``module.``) removed. Installs nothing.
    """
    fqns: set[str] = set()
    for table in find_zch_tables(model, check_modules=False):
        fqns.update(table.embedding_fqns)
    return fqns


def find_zch_tables(model: torch.nn.Module, check_modules: bool = True) -> list[ZchTable]:
    """Locate every ZCH table of ``model`` on this rank (nothing is installed).

    Args:
        model: a DMP-wrapped or plain model.
        check_modules: raise for managed-collision modules that are not MCH modules.
    """
    sharded_cls, plain_cls = _mc_classes()
    found: list[ZchTable] = []
    for fqn, module in model.named_modules():
        if isinstance(module, sharded_cls):
            found.extend(_sharded_tables(fqn, module, check_modules))
        elif isinstance(module, plain_cls):
            found.extend(_unsharded_tables(fqn, module, check_modules))
    return found


def _mc_classes() -> tuple[type, type]:
    from torchrec.distributed.mc_embedding_modules import (
        BaseShardedManagedCollisionEmbeddingCollection,
    )
    from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

    return BaseShardedManagedCollisionEmbeddingCollection, BaseManagedCollisionEmbeddingCollection


def _clean_fqn(fqn: str) -> str:
    parts = [p for p in fqn.split(".") if p]
    while parts and parts[0] in ("_dmp_wrapped_module", "module", "_orig_mod"):
        parts.pop(0)
    return ".".join(parts)


def _fqns(owner: str, bagged: bool, name: str) -> tuple[str, ...]:
    prefix = f"{owner}." if owner else ""
    group = "embedding_bags" if bagged else "embeddings"
    return (
        f"{prefix}_embedding_module.{group}.{name}",
        f"{prefix}_managed_collision_collection._managed_collision_modules.{name}",
    )


def _mch_modules(module_fqn: str, modules: Any, check: bool) -> Iterator[tuple[str, Any]]:
    from torchrec.modules.mc_modules import MCHManagedCollisionModule

    for name, mch in modules.items():
        if isinstance(mch, MCHManagedCollisionModule):
            yield name, mch
        elif check:
            raise ZchUnsupportedError(
                table_id(module_fqn, name),
                f"managed-collision module {type(mch).__name__} is not supported "
                "(only MCHManagedCollisionModule)",
            )


def _param_reader(module: torch.nn.Module, name: str) -> Callable[[], torch.Tensor]:
    """A function returning the module's parameter ``name`` as it is when called."""

    def read() -> torch.Tensor:
        return module.get_parameter(name)

    return read


def _tables(
    fqn: str, module: Any, bagged: bool, check: bool, place: Callable[[str, Any], ZchPlacement]
) -> list[ZchTable]:
    """The module's MCH tables; ``place(name, mch)`` says where each one's rows live."""
    owner = _clean_fqn(fqn)
    modules = module._managed_collision_collection._managed_collision_modules
    return [
        ZchTable(
            table_id=table_id(fqn, name),
            module_fqn=fqn,
            table_name=name,
            mch=mch,
            embedding_fqns=_fqns(owner, bagged, name),
            **vars(place(name, mch)),
        )
        for name, mch in _mch_modules(fqn, modules, check)
    ]


def _embedding_group(module: Any, bagged: bool) -> Any:
    emb = module._embedding_module
    return emb.embedding_bags if bagged else emb.embeddings


def _unsharded_tables(fqn: str, module: Any, check: bool) -> list[ZchTable]:
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection

    bagged = isinstance(module, ManagedCollisionEmbeddingBagCollection)
    group = _embedding_group(module, bagged)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def place(name: str, mch: Any) -> ZchPlacement:
        weight = _param_reader(group[name], "weight")
        return ZchPlacement(weight, 0, int(mch._zch_size), False, rank, 1)

    return _tables(fqn, module, bagged, check, place)


def _sharded_tables(fqn: str, module: Any, check: bool) -> list[ZchTable]:
    bagged = bool(module.bagged)
    group = _embedding_group(module, bagged)
    configs = module._embedding_module._table_name_to_config
    offsets = module._managed_collision_collection._table_to_offset
    env = module._env

    def place(name: str, mch: Any) -> ZchPlacement:
        weight = _param_reader(group, f"{name}.weight")
        rows = int(configs[name].num_embeddings)
        return ZchPlacement(
            weight, int(offsets[name]), rows, True, int(env.rank), int(env.world_size)
        )

    return _tables(fqn, module, bagged, check, place)
