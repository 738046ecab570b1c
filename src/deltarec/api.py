"""The public API of deltarec for a team's training program: everything it needs, in one place.

A training program that runs as the pipeline's train step (``--entry-point``) uses only these
names (docs/api.md shows a complete program)::

    from deltarec.api import hook_from_env, TrainSettings

    settings = TrainSettings.from_env()      # the pipeline's DELTAREC_* variables
    hook = hook_from_env()                    # the dump (and publish) hook
    hook.on_start(dmp_model, step=0, restored_from=None)
    for step in range(1, settings.steps + 1):
        ...                                   # forward, backward, optimizer step
        hook.after_step(step)
    hook.on_end(step)
    hook.close()                              # on every exit path

Exports:
    hook_from_env: the dump hook from the ``DELTAREC_*`` environment.
    make_train_hook: the dump hook from explicit keyword arguments.
    TrainSettings, ENV_PREFIX: the environment variables, as one typed object.
    DumpHook: the hook (``on_start``, ``after_step``, ``before_eval``, ``after_eval``,
        ``on_end``, ``close``, ``state_dict``, ``load_state_dict``).
    TrainHook: the protocol a training loop calls (what ``DumpHook`` implements).
    DumperConfig: the further dump options ``hook_from_env(**options)`` accepts.
    TableSource, TouchedRows: the table-source protocol, for tables outside
        ``DistributedModelParallel`` (``hook_from_env(sources=...)``).
    RowShardSource, ManualTracker, TrackerHub: a ready source for a plain ``torch`` table
        (a CUDA or CPU tensor, or this rank's block of rows of one), fed by recording the
        looked-up ids by hand (docs/api.md shows it).
    TableSpec, DType, TableKind: how a table is described (GENERATION.json).
    discover_sources: the default source factory (the tables of a DMP model).

Importing this module imports torch (the hook runs in the training processes).
"""

from __future__ import annotations

from deltarec.artifacts.types import DType, TableKind, TableSpec
from deltarec.dump.config import DumperConfig
from deltarec.dump.env import ENV_PREFIX, TrainSettings
from deltarec.dump.hook import DumpHook, hook_from_env, make_train_hook
from deltarec.tracking.discovery import discover_sources
from deltarec.tracking.plain import RowShardSource
from deltarec.tracking.tracker import ManualTracker, TrackerHub
from deltarec.tracking.types import TableSource, TouchedRows
from deltarec.train.hooks import TrainHook

__all__ = [
    "ENV_PREFIX",
    "DType",
    "DumpHook",
    "DumperConfig",
    "ManualTracker",
    "RowShardSource",
    "TableKind",
    "TableSource",
    "TableSpec",
    "TouchedRows",
    "TrackerHub",
    "TrainHook",
    "TrainSettings",
    "discover_sources",
    "hook_from_env",
    "make_train_hook",
]
