"""Touched local rows per embedding table, read from torchrec's delta tracker.

One :class:`TrackerHub` per model wraps ``DistributedModelParallel``'s delta tracker
(``TrackingMode.ID_ONLY``, ``delete_on_read=True``). The tracker records, after the input
distribution, the **local** row indices of this rank's shard that each lookup touched, keyed by
the embedding FQN (``sparse.ebc.embedding_bags.user_id``). The hub drains the tracker into
per-FQN pending lists, so several sources can take their ids independently, and evaluation
lookups can be dropped without losing the training lookups recorded before them.

The hub reads the tracker's store (``store.per_fqn_lookups``) itself and empties it, as
``get_unique()`` with ``delete_on_read`` would, then deduplicates once per table at dump time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from deltarec.dump.gather import dedup_ids

log = logging.getLogger(__name__)


class TrackerHub:
    """Pending touched ids per tracker FQN, shared by the plain sources of one model.

    Args:
        tracker: a torchrec ``ModelDeltaTracker`` (ID_ONLY, delete_on_read) or any object
            with the same ``get_unique()`` and ``store.per_fqn_lookups`` behaviour.
        fqns: the tracker FQNs the hub keeps ids for; others (e.g. ZCH tables) are dropped.
    """

    def __init__(self, tracker: Any, fqns: set[str]) -> None:
        self.tracker = tracker
        self.fqns = set(fqns)
        self._pending: dict[str, list[torch.Tensor]] = {f: [] for f in self.fqns}

    def _read(self) -> dict[str, list[torch.Tensor]]:
        """Drain the tracker: ``{fqn: [id tensors]}`` recorded since the previous read.

        The recorded lookups are taken from the tracker's store directly and the store is
        emptied: what ``get_unique()`` does with ``delete_on_read`` and one consumer, without
        its two ``torch.unique`` passes over every table (the sort dominated the dump's
        training-thread time on CPU). :meth:`take` deduplicates once per table, with a bitmap
        where that is cheaper. Trackers without such a store are read with ``get_unique()``.
        """
        store = getattr(self.tracker, "store", None)
        lookups = getattr(store, "per_fqn_lookups", None)
        if store is not None and isinstance(lookups, dict):
            store.per_fqn_lookups = {}
            return {f: [getattr(x, "ids", x) for x in v] for f, v in lookups.items() if v}
        return {fqn: [rows.ids] for fqn, rows in self.tracker.get_unique().items()}

    def poll(self) -> None:
        """Move every id the tracker recorded into the pending lists."""
        for fqn, parts in self._read().items():
            if fqn in self._pending:
                self._pending[fqn].extend(p for p in parts if p.numel())

    def take(self, fqn: str, num_rows: int | None = None) -> torch.Tensor | None:
        """All pending ids of ``fqn``, sorted and unique (None if there are none), cleared.

        Args:
            fqn: the tracker FQN.
            num_rows: rows of the table's local part (lets :func:`dedup_ids` use a bitmap).
        """
        self.poll()
        parts = self._pending.get(fqn)
        if not parts:
            return None
        self._pending[fqn] = []
        return dedup_ids(parts[0] if len(parts) == 1 else torch.cat(parts), num_rows)

    def hold(self) -> None:
        """Evaluation begins: keep what training recorded so far."""
        self.poll()

    def drop_recorded(self) -> None:
        """Evaluation ended: forget everything recorded since :meth:`hold` (idempotent)."""
        self._read()

    def discard_all(self) -> None:
        """Forget every pending and recorded id (at a generation's start)."""
        self._read()
        for fqn in self._pending:
            self._pending[fqn] = []


@dataclass
class _Unique:
    ids: torch.Tensor


class ManualTracker:
    """A tracker fed by hand: ``record(fqn, ids)`` after each lookup (no torchrec needed).

    For tables outside DistributedModelParallel (a plain ``torch`` table, benchmarks, tests):
    it answers ``get_unique()`` like torchrec's tracker in ID_ONLY mode with delete_on_read.
    """

    def __init__(self) -> None:
        self.store = self
        self.per_fqn_lookups: dict[str, list[torch.Tensor]] = {}

    def record(self, fqn: str, ids: torch.Tensor) -> None:
        """Record the local row ids one lookup touched."""
        self.per_fqn_lookups.setdefault(fqn, []).append(ids.reshape(-1))

    def get_unique(self) -> dict[str, _Unique]:
        """Unique ids per FQN since the previous call; forgets them."""
        out = {
            fqn: _Unique(torch.unique(torch.cat(parts)))
            for fqn, parts in self.per_fqn_lookups.items()
            if parts
        }
        self.per_fqn_lookups = {}
        return out
