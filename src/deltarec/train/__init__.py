"""Training the example model: the loop, checkpoints, the full table export, the hooks.

Exports: :class:`TrainConfig`, :func:`run_training`, :class:`TrainResult`,
:class:`DataExhaustedError`, :class:`CheckpointError`, :class:`TrainError`,
:class:`TrainHook`, :func:`export_tables`, :func:`table_rows`, :class:`CheckpointManager`,
:func:`init_distributed`.

Only the errors are imported eagerly; everything else (torch, torchrec) is loaded on first
use, so ``deltarec train --nproc-per-node N`` can validate its flags and start torchrun
without importing torch in the launching process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltarec._lazy import lazy_exports
from deltarec.train.errors import CheckpointError, DataExhaustedError, TrainError

if TYPE_CHECKING:
    from deltarec.train.checkpoint import CheckpointManager
    from deltarec.train.config import TrainConfig
    from deltarec.train.export import export_tables, table_rows
    from deltarec.train.hooks import TrainHook
    from deltarec.train.launch import init_distributed
    from deltarec.train.loop import TrainResult, run_training

_LAZY = {
    "TrainHook": "deltarec.train.hooks",
    "TrainConfig": "deltarec.train.config",
    "run_training": "deltarec.train.loop",
    "TrainResult": "deltarec.train.loop",
    "export_tables": "deltarec.train.export",
    "table_rows": "deltarec.train.export",
    "CheckpointManager": "deltarec.train.checkpoint",
    "init_distributed": "deltarec.train.launch",
}

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "DataExhaustedError",
    "TrainConfig",
    "TrainError",
    "TrainHook",
    "TrainResult",
    "export_tables",
    "init_distributed",
    "run_training",
    "table_rows",
]


__getattr__ = lazy_exports(__name__, _LAZY)
