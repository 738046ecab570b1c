"""Touched local rows per embedding table, read from torchrec's delta tracker.

One :class:`TrackerHub` per model wraps ``DistributedModelParallel``'s delta tracker
(``TrackingMode.ID_ONLY``, ``delete_on_read=True``). The tracker records, after the input
distribution, the **local** row indices of this rank's shard that each lookup touched, keyed by
the embedding FQN (``sparse.ebc.embedding_bags.user_id``). The hub drains the tracker into
per-FQN pending lists, so several sources can take their ids independently, and evaluation
lookups can be dropped without losing the training lookups recorded before them.

torchrec 1.8's ``get_unique()`` raises ``ValueError`` (``torch.cat`` of nothing) when a table
saw no lookup since the previous read; the hub never calls it in that state.
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

    def _read(self) -> dict[str, torch.Tensor]:
        """Drain the tracker: ``{fqn: local ids}`` recorded since the previous read."""
        store = getattr(self.tracker, "store", None)
        lookups = getattr(store, "per_fqn_lookups", None)
        if isinstance(lookups, dict):
            # Drop FQNs whose lookups were all consumed; get_unique() would cat an empty list.
            for fqn in [f for f, v in lookups.items() if not v]:
                del lookups[fqn]
            if not lookups:
                return {}
        out = {}
        for fqn, rows in self.tracker.get_unique().items():
            out[fqn] = rows.ids
        return out

    def poll(self) -> None:
        """Move every id the tracker recorded into the pending lists."""
        for fqn, ids in self._read().items():
            if fqn in self._pending and ids.numel():
                self._pending[fqn].append(ids)

    def take(self, fqn: str) -> torch.Tensor | None:
        """All pending ids of ``fqn``, sorted and unique (None if there are none), cleared.

        One read of the tracker is already sorted and unique (``get_unique``); ids gathered
        over several reads (an evaluation pause in between) are deduplicated here.
        """
        self.poll()
        parts = self._pending.get(fqn)
        if not parts:
            return None
        self._pending[fqn] = []
        if len(parts) == 1:
            return parts[0]
        return dedup_ids(torch.cat(parts))

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
