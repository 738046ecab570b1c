"""Small object exchanges between ranks on the dumper's own gloo groups.

The dumper never runs a collective on the training process group from a background thread:
it creates two gloo groups of its own at start (on the training thread, every rank at once),
one used only by the training thread (clock agreement at agreed steps, final-step check) and
one used only by the background worker (column-wise and data-parallel assembly, commit).
Each group is used by exactly one thread per rank, in the same order on every rank.

Without ``torch.distributed`` (one process) an :class:`Exchange` is local and trivial.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any

import torch.distributed as dist


class Exchange:
    """Object collectives on one dedicated group, or local when not distributed.

    Args:
        group: a gloo process group, or None for a single process.
    """

    def __init__(self, group: Any | None) -> None:
        self.group = group
        if group is None:
            self.rank, self.world_size = 0, 1
        else:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)

    @classmethod
    def create(cls, timeout_s: float) -> Exchange:
        """A new exchange over every rank (collective: every rank calls it at the same point)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls(None)
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        return cls(group)

    @property
    def distributed(self) -> bool:
        """True when there are other ranks."""
        return self.group is not None

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj: Any, dst: int) -> list[Any] | None:
        """Every rank's ``obj`` on ``dst`` (in rank order); None on the other ranks."""
        if self.group is None:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dist.get_global_rank(self.group, dst), group=self.group)
        return out

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``src``'s ``obj`` on every rank."""
        if self.group is None:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, src), group=self.group)
        return box[0]

    def close(self) -> None:
        """Destroy the group (best effort; the default group may already be gone)."""
        if self.group is not None and dist.is_initialized():
            with contextlib.suppress(RuntimeError, ValueError):
                dist.destroy_process_group(self.group)
        self.group = None
