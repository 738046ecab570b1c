"""Touched local rows per embedding table, read from torchrec's delta tracker.

One :class:`TrackerHub` per model wraps ``DistributedModelParallel``'s delta tracker
(``TrackingMode.ID_ONLY``, ``delete_on_read=True``). The tracker records, after the input
distribution, the **local** row indices of this rank's shard that each lookup touched, keyed by
the embedding FQN (``sparse.ebc.embedding_bags.user_id``). The hub drains the tracker into
per-FQN pending lists, so several sources can take their ids independently, and evaluation
lookups can be dropped without losing the training lookups recorded before them.

The hub reads the tracker's store (``store.per_fqn_lookups``) itself and empties it, as
``get_unique()`` with ``delete_on_read`` would, then deduplicates once per table at dump time.

No lookup is dropped silently: every path the tracker reports is either one the hub keeps ids
for, one it was told belongs to another source (ZCH tables), or an error
(:class:`~deltarec.tracking.errors.TrackingError`, naming the path and the tables whose
features the tracker files under it) that stops the dump. Tables torchrec's tracker cannot
attribute are recorded by :class:`~deltarec.tracking.lookups.LookupRecorder` instances, which
the hub drains with the tracker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from deltarec.tracking.errors import TrackingError
from deltarec.tracking.gather import dedup_ids

log = logging.getLogger(__name__)


class TrackerHub:
    """Pending touched ids per path, shared by the plain sources of one model.

    Args:
        tracker: a torchrec ``ModelDeltaTracker`` (ID_ONLY, delete_on_read) or any object
            with the same ``get_unique()`` and ``store.per_fqn_lookups`` behaviour; None when
            every table is recorded by ``recorders``.
        fqns: the paths the hub keeps ids for (the keys the sources take).
        recorders: further stores of lookups (``per_fqn_lookups``, e.g.
            :class:`~deltarec.tracking.lookups.LookupRecorder`), drained with the tracker and
            closed by :meth:`close`.
        tracker_fqns: the paths ``tracker`` may report ids under (default: ``fqns``).
        ignored: paths ``tracker`` may report that other sources track (ZCH tables).
        explain: path -> the table ids whose lookups the tracker files under it (for the
            error raised for a path the hub does not know).
        checks: called at every read; each raises
            :class:`~deltarec.tracking.errors.TrackingError` if lookups may have gone
            unrecorded (the recorders' ``check`` methods are added).
    """

    def __init__(
        self,
        tracker: Any,
        fqns: set[str],
        *,
        recorders: Iterable[Any] = (),
        tracker_fqns: Iterable[str] | None = None,
        ignored: Iterable[str] = (),
        explain: Callable[[str], list[str]] | None = None,
        checks: Iterable[Callable[[], None]] = (),
    ) -> None:
        self.tracker = tracker
        self.fqns = set(fqns)
        self.recorders = list(recorders)
        self.tracker_fqns = set(self.fqns if tracker_fqns is None else tracker_fqns)
        self.ignored = set(ignored)
        self._explain = explain
        self._checks = [*checks, *(r.check for r in self.recorders if hasattr(r, "check"))]
        self._pending: dict[str, list[torch.Tensor]] = {f: [] for f in self.fqns}
        self._watchers: dict[str, Callable[[torch.Tensor], None]] = {}
        self._listening: bool | None = None  # None: not tried yet

    def _read(self, strict: bool = True) -> dict[str, list[torch.Tensor]]:
        """Drain the tracker and the recorders: ``{path: [id tensors]}`` since the last read.

        Args:
            strict: check what was recorded (False: everything is being forgotten anyway).

        Raises:
            TrackingError: the tracker reported ids under a path the hub does not know.
        """
        out: dict[str, list[torch.Tensor]] = {}
        unknown: dict[str, int] = {}
        if self.tracker is not None:
            for fqn, parts in _drain(self.tracker).items():
                if fqn in self.tracker_fqns:
                    out.setdefault(fqn, []).extend(parts)
                elif fqn not in self.ignored:
                    unknown[fqn] = sum(int(p.numel()) for p in parts)
        if strict and unknown:
            self._unknown(unknown)
        for check in self._checks if strict else ():
            check()
        for recorder in self.recorders:
            for fqn, parts in _drain(recorder).items():
                out.setdefault(fqn, []).extend(parts)
        return out

    def _unknown(self, unknown: dict[str, int]) -> None:
        tables: list[str] = []
        said = []
        for fqn, n in sorted(unknown.items()):
            owners = self._explain(fqn) if self._explain is not None else []
            tables += [t for t in owners if t not in tables]
            whose = f"features of {owners}" if owners else "no known table's features"
            said.append(f"{fqn!r} ({n} id(s); it files {whose} there)")
        raise TrackingError(
            tables,
            sorted(unknown),
            "torchrec's delta tracker reported looked-up ids under "
            + ", ".join(said)
            + f", but deltarec takes from it only {sorted(self.tracker_fqns)}; the rows "
            "these lookups touched cannot be attributed, so the dump stops instead of leaving "
            "them stale (a table and a module with the same name, or a tracker attached after "
            "the dumper started?)",
        )

    def poll(self) -> None:
        """Move every id recorded so far into the pending lists (raises on unknown paths)."""
        for fqn, parts in self._read().items():
            pending = self._pending.get(fqn)
            if pending is not None:
                pending.extend(parts)

    def take(self, fqn: str, num_rows: int | None = None) -> torch.Tensor | None:
        """All pending ids of ``fqn``, sorted and unique (None if there are none), cleared.

        Args:
            fqn: the tracker FQN.
            num_rows: rows of the table's local part (lets :func:`dedup_ids` use a bitmap).
        """
        ids = self.take_recorded(fqn)
        return None if ids is None else dedup_ids(ids, num_rows)

    def take_recorded(self, fqn: str) -> torch.Tensor | None:
        """All pending ids of ``fqn`` as recorded (duplicates kept; None if none), cleared."""
        parts = self.take_parts(fqn)
        if not parts:
            return None
        ids = parts[0].reshape(-1) if len(parts) == 1 else torch.cat(parts)
        return ids if ids.numel() else None

    def take_parts(self, fqn: str, poll: bool = True) -> list[torch.Tensor]:
        """The pending id tensors of ``fqn``, one per recorded lookup (1-D), cleared.

        Args:
            fqn: the tracker FQN.
            poll: drain the tracker first (False: a caller taking several paths at once has
                just called :meth:`poll`).
        """
        if poll:
            self.poll()
        parts = self._pending.get(fqn)
        if not parts:
            return []
        self._pending[fqn] = []
        return parts

    def watch(self, fqn: str, fn: Callable[[torch.Tensor], None]) -> bool:
        """Call ``fn(ids)`` with each lookup of ``fqn`` as it is recorded (in the forward).

        For a spread dump's copies on write (:mod:`deltarec.tracking.spread`). Returns False,
        and watches nothing, where a tracker or recorder offers no way to see lookups as they
        are recorded (one read with ``get_unique()`` alone).
        """
        if self._listening is None:
            sources = [t for t in (self.tracker, *self.recorders) if t is not None]
            self._listening = all(_can_listen(t) for t in sources)
            if self._listening:
                for t in sources:
                    _listen(t, self._notify)
        if not self._listening:
            return False
        self._watchers[fqn] = fn
        return True

    def unwatch(self, fqn: str) -> None:
        """Stop calling what :meth:`watch` gave for ``fqn`` (idempotent)."""
        self._watchers.pop(fqn, None)

    def _notify(self, fqn: str, ids: torch.Tensor) -> None:
        fn = self._watchers.get(fqn)
        if fn is not None:
            fn(ids)

    def hold(self) -> None:
        """Evaluation begins: keep what training recorded so far."""
        self.poll()

    def drop_recorded(self) -> None:
        """Evaluation ended: forget everything recorded since :meth:`hold` (idempotent)."""
        self._read()

    def discard_all(self) -> None:
        """Forget every pending and recorded id (at a generation's start, unchecked)."""
        self._read(strict=False)
        for fqn in self._pending:
            self._pending[fqn] = []

    def close(self) -> None:
        """Remove the recorders' hooks (idempotent)."""
        for recorder in self.recorders:
            close = getattr(recorder, "close", None)
            if close is not None:
                close()


def _can_listen(tracker: Any) -> bool:
    """Whether :func:`_listen` can see ``tracker``'s lookups as they are recorded."""
    if isinstance(getattr(tracker, "listeners", None), list):
        return True
    return callable(getattr(getattr(tracker, "store", None), "append", None))


def _listen(tracker: Any, fn: Callable[[str, torch.Tensor], None]) -> None:
    """Call ``fn(path, ids)`` with every lookup ``tracker`` records, after it records it.

    deltarec's recorders and :class:`ManualTracker` keep a list of listeners; torchrec's
    tracker files each lookup with ``store.append(batch_idx=, fqn=, ids=, ...)``, which is
    wrapped on the store instance (never on its class).
    """
    listeners = getattr(tracker, "listeners", None)
    if isinstance(listeners, list):
        listeners.append(fn)
        return
    store = tracker.store
    append = store.append

    def recorded(*args: Any, **kwargs: Any) -> Any:
        out = append(*args, **kwargs)
        fqn = kwargs["fqn"] if "fqn" in kwargs else args[1]
        ids = kwargs["ids"] if "ids" in kwargs else args[2]
        fn(fqn, ids)
        return out

    store.append = recorded


def _drain(tracker: Any) -> dict[str, list[torch.Tensor]]:
    """``{path: [id tensors]}`` recorded by ``tracker`` since the previous drain.

    The recorded lookups are taken from the tracker's store directly and the store is emptied:
    what ``get_unique()`` does with ``delete_on_read`` and one consumer, without its two
    ``torch.unique`` passes over every table (the sort dominated the dump's training-thread
    time on CPU). :meth:`TrackerHub.take` deduplicates once per table, with a bitmap where
    that is cheaper. Trackers without such a store are read with ``get_unique()``.
    """
    store = getattr(tracker, "store", None)
    lookups = getattr(store, "per_fqn_lookups", None)
    if store is not None and isinstance(lookups, dict):
        store.per_fqn_lookups = {}
        return {
            f: v if isinstance(v[0], torch.Tensor) else [x.ids for x in v]  # torchrec's lookups
            for f, v in lookups.items()
            if v
        }
    return {fqn: [rows.ids] for fqn, rows in tracker.get_unique().items()}


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
        self.listeners: list[Callable[[str, torch.Tensor], None]] = []
        """Called with ``(fqn, ids)`` after each :meth:`record` (see ``TrackerHub.watch``)."""

    def record(self, fqn: str, ids: torch.Tensor) -> None:
        """Record the local row ids one lookup touched (before the step updates them)."""
        flat = ids if ids.dim() == 1 else ids.reshape(-1)  # a reshape is a dispatched call
        self.per_fqn_lookups.setdefault(fqn, []).append(flat)
        for fn in self.listeners:
            fn(fqn, flat)

    def get_unique(self) -> dict[str, _Unique]:
        """Unique ids per FQN since the previous call; forgets them."""
        out = {
            fqn: _Unique(torch.unique(torch.cat(parts)))
            for fqn, parts in self.per_fqn_lookups.items()
            if parts
        }
        self.per_fqn_lookups = {}
        return out
