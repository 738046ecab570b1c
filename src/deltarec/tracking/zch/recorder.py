"""Instance-level recording of what one ``MCHManagedCollisionModule`` does between dumps.

The recorder replaces two bound methods on ONE module instance (never on the class) and puts
them back in :meth:`MchRecorder.close`:

* ``remap``: every lookup. The remapped rows are validated against the local shard's row
  range (before the embedding lookup reads them); in training mode the raw ids looked up are
  recorded, and whether any of them went to the shared miss (fallback) slot. Ids that went to
  the miss slot are kept only with :attr:`MchRecorder.keep_misses` (they are the ids the model
  answers with the fallback row); otherwise they are dropped at the next compaction.
* ``_update_and_evict``: the only place where the raw id → slot mapping changes. While it
  runs, the module's eviction policy object gets an instance-level wrapper of
  ``update_metadata_and_generate_eviction_scores`` (removed again before the call returns),
  which sees the positions being replaced: the raw ids that leave (evicted) and the raw ids
  that enter (admitted), with the slot each one enters, are recorded from those positions, so
  nothing scans the mapping.

Work per step is O(batch); work per eviction is O(ids in the eviction history). Memory is
bounded by the distinct ids recorded since the previous ``take``: lookups are compacted to one
entry per id (its last) whenever they grow past twice the last compacted size. At collect
time the recorded events alone say which ids are held and where (a held id keeps its slot
until it is evicted), so the mapping buffers are not read at all.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from deltarec.artifacts.types import FALLBACK_KEY
from deltarec.tracking.zch.errors import ZchRowRangeError, ZchTrackingError

EMPTY_ID = torch.iinfo(torch.int64).max
"""The value ``MCHManagedCollisionModule`` keeps in ``_mch_sorted_raw_ids`` for an empty slot."""

_MARK = "_deltarec_zch_recorder"
_POLICY_FN = "update_metadata_and_generate_eviction_scores"
_COMPACT_MIN = 1 << 20


@dataclass
class Recorded:
    """What one MCH module did between two ``take`` calls (int64 tensors on its device).

    Attributes:
        ids: raw ids looked up in training (and held then), admitted or evicted; sorted,
            unique.
        rows: per id, the global row it holds now, or ``-1`` if it holds none: its last change
            was an eviction, or (with ``keep_misses``) it was only looked up, and only as a
            miss. An id's admissions and evictions decide its row; an id that was only looked
            up keeps the row it was remapped to (a held id keeps its slot until it is evicted,
            an id not held maps to the miss slot until it is admitted).
        miss: whether a training lookup went to the miss (fallback) slot.
    """

    ids: torch.Tensor
    rows: torch.Tensor
    miss: bool


def _last_of_each(
    ids: torch.Tensor, rows: torch.Tensor, drop_row: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique ids (sorted) with the row of their last occurrence, leaving out ``drop_row``.

    ``drop_row`` None keeps every id.
    """
    ids, order = torch.sort(ids, stable=True)
    rows = rows[order]
    keep = torch.ones_like(ids, dtype=torch.bool)
    torch.ne(ids[1:], ids[:-1], out=keep[:-1])
    if drop_row is not None:
        keep &= rows != drop_row
    return ids[keep], rows[keep]


class MchRecorder:
    """Records lookups, admissions and evictions of one MCH module instance.

    Args:
        table: the table id (for error messages).
        mch: the ``MCHManagedCollisionModule`` (this rank's shard of the table).
        row_low: the first global row of this rank's embedding shard.
        row_high: the end (exclusive) of this rank's embedding shard, in global rows.

    Raises:
        ZchTrackingError: if the module is already tracked by another open recorder.
    """

    def __init__(self, table: str, mch: Any, row_low: int, row_high: int) -> None:
        if mch.__dict__.get(_MARK) is not None:
            raise ZchTrackingError(
                table, "already tracked by another open source; close() it before tracking again"
            )
        _check_internals(table, mch)
        self.table = table
        self.mch: Any = mch
        self.row_low = row_low
        self.row_high = row_high
        device = mch._mch_sorted_raw_ids.device
        self._lookups: list[torch.Tensor] = []
        self._lookup_rows: list[torch.Tensor] = []
        self._event_ids: list[torch.Tensor] = []  # admissions and evictions, in time order
        self._event_rows: list[torch.Tensor] = []  # the slot entered, or -1 for an eviction
        self._pending = 0
        self._compact_at = _COMPACT_MIN
        self._miss = torch.zeros((), dtype=torch.bool, device=device)
        self.paused = False
        self.keep_misses = False
        self._orig_remap: Callable[..., Any] = mch.remap
        self._orig_update: Callable[..., Any] = mch._update_and_evict
        mch.__dict__[_MARK] = self
        mch.__dict__["remap"] = self._remap
        mch.__dict__["_update_and_evict"] = self._update_and_evict

    # ---- state read by the table source -------------------------------------------------

    @property
    def miss_slot(self) -> int:
        """The global row of the shared miss (fallback) slot of this shard."""
        return int(self.mch._output_global_offset) + int(self.mch._zch_size) - 1

    def take(self) -> Recorded:
        """Return and reset what was recorded since the previous ``take``.

        Ids that were only looked up, and only as misses (never held), come back with row
        ``-1`` when :attr:`keep_misses` is set (raw id ``-1``, the fallback key, excepted) and
        are left out otherwise.
        """
        empty = torch.empty(0, dtype=torch.int64, device=self._miss.device)
        miss = self.miss_slot
        # Events after lookups: an id's last admission/eviction outranks any lookup of it.
        # Without an event since the previous take an id's lookups all agree (held at one
        # slot, or missed), so its last lookup says where it is now.
        ids, rows = _last_of_each(
            torch.cat([empty, *self._lookups, *self._event_ids]),
            torch.cat([empty, *self._lookup_rows, *self._event_rows]),
            drop_row=None if self.keep_misses else miss,
        )
        if self.keep_misses:
            missed = rows == miss
            rows = rows.masked_fill(missed, -1)
            keep = ~(missed & (ids == FALLBACK_KEY))
            ids, rows = ids[keep], rows[keep]
        recorded = Recorded(ids, rows, bool(self._miss.item()))
        self._lookups, self._lookup_rows, self._event_ids, self._event_rows = [], [], [], []
        self._pending = 0
        self._compact_at = _COMPACT_MIN
        self._miss.zero_()
        return recorded

    def check_rows(self, rows: torch.Tensor, where: str) -> None:
        """Raise :class:`ZchRowRangeError` if any global row is outside this rank's shard."""
        if rows.numel() == 0:
            return
        low, high = torch.stack(torch.aminmax(rows)).tolist()  # one host sync
        if low >= self.row_low and high < self.row_high:
            return
        bad = rows[(rows < self.row_low) | (rows >= self.row_high)]
        raise ZchRowRangeError(
            self.table, torch.unique(bad).tolist(), self.row_low, self.row_high, where
        )

    def close(self) -> None:
        """Put the module's own methods back (idempotent)."""
        d = self.mch.__dict__
        if d.get(_MARK) is not self:
            return
        for name in ("remap", "_update_and_evict"):
            d.pop(name, None)
        d.pop(_MARK, None)

    # ---- the instance-level wrappers ---------------------------------------------------

    def _remap(self, features: dict[str, Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        out: dict[str, Any] = self._orig_remap(features, *args, **kwargs)
        training = self.mch.training
        miss = self.miss_slot
        for name, jt in out.items():
            rows = jt.values()
            self.check_rows(rows, "a lookup")
            if training and not self.paused and name in features:
                self._record_lookup(features[name].values(), rows, miss)
        return out

    def _record_lookup(self, raw: torch.Tensor, rows: torch.Tensor, miss: int) -> None:
        self._lookups.append(raw.detach().to(torch.int64).clone())
        self._lookup_rows.append(rows.detach().to(torch.int64).clone())
        self._miss |= (rows == miss).any()
        self._pending += int(raw.numel())
        if self._pending >= self._compact_at:
            ids, at = _last_of_each(
                torch.cat(self._lookups),
                torch.cat(self._lookup_rows),
                drop_row=None if self.keep_misses else miss,
            )
            self._lookups, self._lookup_rows = [ids], [at]
            self._pending = int(ids.numel())
            self._compact_at = max(_COMPACT_MIN, 2 * self._pending)

    def _update_and_evict(
        self, uniq_ids: torch.Tensor, uniq_ids_counts: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        policy = self.mch._eviction_policy
        orig_policy_fn = getattr(policy, _POLICY_FN)
        signature = inspect.signature(orig_policy_fn)
        seen: dict[str, torch.Tensor] = {}
        mch = self.mch

        def policy_fn(*p_args: Any, **p_kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            evicted_pos, selected_new = orig_policy_fn(*p_args, **p_kwargs)
            bound = signature.bind(*p_args, **p_kwargs).arguments
            order = bound["coalesced_history_argsort_mapping"]
            matched = bound["coalesced_history_mch_matching_elements_mask"]
            seen["left"] = mch._mch_sorted_raw_ids[evicted_pos].clone()
            seen["slots"] = mch._mch_remapped_ids_mapping[evicted_pos].clone()
            seen["entered"] = uniq_ids[order][~matched][selected_new]
            return evicted_pos, selected_new

        had_own = _POLICY_FN in policy.__dict__
        policy.__dict__[_POLICY_FN] = policy_fn
        try:
            result = self._orig_update(uniq_ids, uniq_ids_counts, *args, **kwargs)
        finally:
            if had_own:
                policy.__dict__[_POLICY_FN] = orig_policy_fn
            else:
                policy.__dict__.pop(_POLICY_FN, None)
        if "left" not in seen:
            raise ZchTrackingError(
                self.table,
                "the eviction step did not consult the eviction policy; this torchrec "
                "version's MCHManagedCollisionModule is not supported by the ZCH tracking",
            )
        left = seen["left"][seen["left"] != EMPTY_ID]
        self._event_ids += [left, seen["entered"].to(torch.int64)]
        self._event_rows += [torch.full_like(left, -1), seen["slots"]]
        return result


_REQUIRED = (
    "remap",
    "_update_and_evict",
    "_mch_sorted_raw_ids",
    "_mch_remapped_ids_mapping",
    "_output_global_offset",
    "_zch_size",
    "_eviction_policy",
)


def _check_internals(table: str, mch: Any) -> None:
    """Fail early, naming what is missing, if torchrec's MCH module is not the expected one."""
    missing = [name for name in _REQUIRED if not hasattr(mch, name)]
    if not missing and not callable(getattr(mch._eviction_policy, _POLICY_FN, None)):
        missing.append(f"_eviction_policy.{_POLICY_FN}")
    if missing:
        raise ZchTrackingError(
            table,
            f"{type(mch).__name__} lacks {missing}; this torchrec version's managed-collision "
            "internals are not supported by the ZCH tracking",
        )
