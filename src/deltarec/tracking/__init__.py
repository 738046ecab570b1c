"""Row tracking: which embedding rows a training step touched, and how to read them (SPEC §3).

A :class:`TableSource` describes one table to the dumper (its spec, the rows touched since the
last dump, how to read their values); :func:`discover_sources` finds the sources of a model
(plain torchrec tables and, in :mod:`deltarec.tracking.zch`, managed-collision ones). The
gather core (:mod:`deltarec.tracking.gather`) copies touched rows to host memory.

Exports (loaded lazily: every module here but ``errors`` imports torch):
    TableSource, TouchedRows, SourceOptions: the source protocol and what it hands over.
    discover_sources: every source of a model.
    TrackerHub, ManualTracker: the touched-row trackers.
    dedup_ids, gather_to_host, rows_to_host, HostRows: the plain-torch gather core.
    TrackingError: the base of this package's errors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltarec._lazy import lazy_exports

if TYPE_CHECKING:
    from deltarec.tracking.discovery import discover_sources
    from deltarec.tracking.errors import TrackingError
    from deltarec.tracking.gather import HostRows, dedup_ids, gather_to_host, rows_to_host
    from deltarec.tracking.tracker import ManualTracker, TrackerHub
    from deltarec.tracking.types import SourceOptions, TableSource, TouchedRows

_LAZY = {
    "discover_sources": "deltarec.tracking.discovery",
    "TrackingError": "deltarec.tracking.errors",
    "HostRows": "deltarec.tracking.gather",
    "dedup_ids": "deltarec.tracking.gather",
    "gather_to_host": "deltarec.tracking.gather",
    "rows_to_host": "deltarec.tracking.gather",
    "ManualTracker": "deltarec.tracking.tracker",
    "TrackerHub": "deltarec.tracking.tracker",
    "SourceOptions": "deltarec.tracking.types",
    "TableSource": "deltarec.tracking.types",
    "TouchedRows": "deltarec.tracking.types",
}

__all__ = [
    "HostRows",
    "ManualTracker",
    "SourceOptions",
    "TableSource",
    "TouchedRows",
    "TrackerHub",
    "TrackingError",
    "dedup_ids",
    "discover_sources",
    "gather_to_host",
    "rows_to_host",
]

__getattr__ = lazy_exports(__name__, _LAZY)
