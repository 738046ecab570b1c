"""Serving replicas: a run's tables and dense state in memory, fed by the outbox (issue 29).

A replica holds one promoted point of a run (every table's rows as stored, in torch tensors
on CPU or GPU, and the dense state committed with it), follows the committed dumps of its
generation in order, each applied atomically, switches generations only when the serving
pointer moves (promote, rollback), resumes from its own recorded state after a restart, and
answers lookups, readback (``replica://host:port`` for ``deltarec verify``) and Prometheus
metrics over HTTP. See docs/serving.md.

Exports (loaded lazily: the records never import torch):
    Replica, Snapshot, DenseState, Line: the replica and what it serves.
    TableState, TableWriter, decode_rows: one table in memory (copy-on-write).
    Follower, FollowOptions, StorePointer, FixedPointer: keeping it on the promoted point.
    ReplicaServer: its HTTP endpoint (status, rows, keys, lookups, metrics).
    ServingModel: a model's scores computed from the replica (dense + sparse of one point).
    Position: a point of a run's lineage. ``ReplicaStatus`` (``GET /v1/status``) is
        :class:`deltarec.stores.ReplicaStatus`, shared with the ``replica://`` store client.
    ReplicaError, SequenceError, GapError, DuplicateDumpError, OutOfOrderError,
        NotReadyError, UnknownTableError: errors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltarec._lazy import lazy_exports

if TYPE_CHECKING:
    from deltarec.serving.follow import FixedPointer, Follower, FollowOptions, StorePointer
    from deltarec.serving.http import ReplicaServer
    from deltarec.serving.model import ServingModel
    from deltarec.serving.replica import DenseState, Line, Replica, Snapshot
    from deltarec.serving.table import TableState, TableWriter, decode_rows
    from deltarec.serving.types import (
        DuplicateDumpError,
        GapError,
        NotReadyError,
        OutOfOrderError,
        Position,
        ReplicaError,
        SequenceError,
        UnknownTableError,
    )

_LAZY = {
    "FixedPointer": "deltarec.serving.follow",
    "Follower": "deltarec.serving.follow",
    "FollowOptions": "deltarec.serving.follow",
    "StorePointer": "deltarec.serving.follow",
    "ReplicaServer": "deltarec.serving.http",
    "ServingModel": "deltarec.serving.model",
    "DenseState": "deltarec.serving.replica",
    "Line": "deltarec.serving.replica",
    "Replica": "deltarec.serving.replica",
    "Snapshot": "deltarec.serving.replica",
    "TableState": "deltarec.serving.table",
    "TableWriter": "deltarec.serving.table",
    "decode_rows": "deltarec.serving.table",
    "DuplicateDumpError": "deltarec.serving.types",
    "GapError": "deltarec.serving.types",
    "NotReadyError": "deltarec.serving.types",
    "OutOfOrderError": "deltarec.serving.types",
    "Position": "deltarec.serving.types",
    "ReplicaError": "deltarec.serving.types",
    "SequenceError": "deltarec.serving.types",
    "UnknownTableError": "deltarec.serving.types",
}

__getattr__ = lazy_exports(__name__, _LAZY)

__all__ = [
    "DenseState",
    "DuplicateDumpError",
    "FixedPointer",
    "FollowOptions",
    "Follower",
    "GapError",
    "Line",
    "NotReadyError",
    "OutOfOrderError",
    "Position",
    "Replica",
    "ReplicaError",
    "ReplicaServer",
    "SequenceError",
    "ServingModel",
    "Snapshot",
    "StorePointer",
    "TableState",
    "TableWriter",
    "UnknownTableError",
    "decode_rows",
]
