"""The delta dump engine: tracked rows become committed generation artifacts (SPEC §3, §4).

The training loop drives a :class:`Dumper` (directly, or through the :class:`DumpHook` that
:func:`make_train_hook` builds for ``deltarec train``). Rows are gathered on the device, copied
to host memory asynchronously, and encoded, written and committed by a background worker; a
queue bounded in bytes makes training wait instead of growing memory.

Exports (loaded lazily; the plain-torch gather core is :mod:`deltarec.tracking.gather`):
    Dumper, DumperConfig: the engine and its configuration.
    DumpHook, make_train_hook: the training-hook adapter and its factory.
    hook_from_env, TrainSettings: the hook from the pipeline's ``DELTAREC_*`` environment.
    DataMismatchError: ranks reached the final dump at different steps.
    RankLostError: an exchange on the dumper's gloo side groups failed (a rank is gone).
    ByteBoundedQueue: the bounded queue.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltarec._lazy import lazy_exports

if TYPE_CHECKING:
    from deltarec.dump.config import DumperConfig
    from deltarec.dump.dumper import DataMismatchError, Dumper
    from deltarec.dump.env import TrainSettings
    from deltarec.dump.exchange import RankLostError
    from deltarec.dump.hook import DumpHook, hook_from_env, make_train_hook
    from deltarec.dump.queue import ByteBoundedQueue

_LAZY = {
    "DumperConfig": "deltarec.dump.config",
    "DataMismatchError": "deltarec.dump.dumper",
    "Dumper": "deltarec.dump.dumper",
    "RankLostError": "deltarec.dump.exchange",
    "DumpHook": "deltarec.dump.hook",
    "make_train_hook": "deltarec.dump.hook",
    "hook_from_env": "deltarec.dump.hook",
    "TrainSettings": "deltarec.dump.env",
    "ByteBoundedQueue": "deltarec.dump.queue",
}

__all__ = [
    "ByteBoundedQueue",
    "DataMismatchError",
    "DumpHook",
    "Dumper",
    "DumperConfig",
    "RankLostError",
    "TrainSettings",
    "hook_from_env",
    "make_train_hook",
]


__getattr__ = lazy_exports(__name__, _LAZY)
