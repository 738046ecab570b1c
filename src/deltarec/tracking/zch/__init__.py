"""ZCH (managed-collision) tables as dump sources (docs/zch.md).

Modules:
    sources: :func:`discover_zch_sources` and :class:`ZchTableSource` (raw ids, admissions,
        evictions, the fallback key ``-1``); :func:`find_zch_tables`, :func:`zch_embedding_fqns`.
    recorder: what one ``MCHManagedCollisionModule`` admits and evicts between dumps.
    errors: the ``Zch*Error`` classes.
    cpu: model set-up fixes to train ZCH tables on CPU (:func:`prepare_zch_for_training`,
        :func:`presize_zch_history`, :func:`install_cpu_eviction_reset`).

This package imports torch; :mod:`deltarec.tracking.discovery` imports it only when a model
is searched for sources.
"""

from __future__ import annotations

from deltarec.tracking.zch.errors import (
    ZchError,
    ZchKeyCollisionError,
    ZchRowRangeError,
    ZchTrackingError,
    ZchUnsupportedError,
)
from deltarec.tracking.zch.sources import (
    ZchTable,
    ZchTableSource,
    discover_zch_sources,
    find_zch_tables,
    zch_embedding_fqns,
)

__all__ = [
    "ZchError",
    "ZchKeyCollisionError",
    "ZchRowRangeError",
    "ZchTable",
    "ZchTableSource",
    "ZchTrackingError",
    "ZchUnsupportedError",
    "discover_zch_sources",
    "find_zch_tables",
    "zch_embedding_fqns",
]
