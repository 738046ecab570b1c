"""Small object exchanges between ranks on the dumper's own gloo groups (side groups).

The dumper never runs a collective on the training process group: whatever the default
group's backend (``nccl`` on GPUs, ``gloo`` on CPU, a mixed ``cpu:gloo,cuda:nccl``), it creates
two gloo groups of its own at start (:meth:`Exchange.create`, on the training thread, every
rank at once, from the default group's store), one used only by the training thread (the table
check and generation allocation at start, clock agreement at agreed steps, the final-step
check, the owner check before a checkpoint) and one used only by the background worker
(column-wise and data-parallel assembly, the commit and its failure rendezvous). Each group is
used by exactly one thread per rank, in the same order on every rank. The exchanged objects
are small Python values pickled into CPU tensors, so nothing of the dumper's is ever enqueued on
a CUDA stream, and beside an NCCL training group no dumper collective waits for (or delays)
the training's kernels.

A rank that dies or stops answering makes every exchange it should have joined fail on the
other ranks with :class:`RankLostError` (gloo notices a closed connection at once; a silent
rank after the group's timeout), so no rank waits for a dead one forever.

Without ``torch.distributed`` (one process) an :class:`Exchange` is local and trivial.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from typing import Any

import torch.distributed as dist

from deltarec.errors import DeltarecError

log = logging.getLogger(__name__)

SIDE_BACKEND = "gloo"
"""The backend of the dumper's own groups: CPU only, usable beside any training backend."""


class RankLostError(DeltarecError):
    """An exchange on the dumper's group failed: another rank is gone or did not answer."""

    def __init__(
        self, group: str, what: str, rank: int, world_size: int, timeout_s: float, cause: str
    ) -> None:
        self.group = group
        self.what = what
        self.rank = rank
        super().__init__(
            f"rank {rank} of {world_size}: {what} on deltarec's {group!r} {SIDE_BACKEND} group "
            f"failed (another rank's process ended, or it did not answer within "
            f"{timeout_s:.0f} s): {cause}"
        )


def default_backend() -> str | None:
    """The default process group's backend (``"nccl"``, ``"gloo"``, ...); None without one."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return str(dist.get_backend())


class Exchange:
    """Object collectives on one dedicated gloo group, or local when not distributed.

    Args:
        group: a gloo process group, or None for a single process.
        name: what the group is for (named in errors), e.g. ``"training-thread"``.
        timeout_s: the group's timeout (named in errors).

    Raises:
        ValueError: if ``group`` is not a gloo group (an exchange must never run on a device
            backend's stream).
    """

    def __init__(self, group: Any | None, name: str = "dump", timeout_s: float = 0.0) -> None:
        self.group = group
        self.name = name
        self.timeout_s = timeout_s
        if group is None:
            self.rank, self.world_size = 0, 1
        else:
            backend = str(dist.get_backend(group))
            if backend != SIDE_BACKEND:
                raise ValueError(f"deltarec's {name!r} exchange needs a gloo group, got {backend}")
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)

    @classmethod
    def create(cls, timeout_s: float, name: str = "dump") -> Exchange:
        """A new exchange over every rank (collective: every rank calls it at the same point).

        Always a new gloo group, never the default group: beside an NCCL (or any device)
        training group it is the CPU side group the dumper's collectives run on, and beside a
        gloo training group it keeps them off the training thread's group all the same.

        Args:
            timeout_s: how long a collective on the group waits for the other ranks.
            name: what the group is for (named in errors and logs).
        """
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls(None, name, timeout_s)
        group = dist.new_group(backend=SIDE_BACKEND, timeout=datetime.timedelta(seconds=timeout_s))
        log.debug(
            "deltarec %r exchange: a %s group of %d ranks beside the default %s group",
            name,
            SIDE_BACKEND,
            dist.get_world_size(),
            default_backend(),
        )
        return cls(group, name, timeout_s)

    @property
    def distributed(self) -> bool:
        """True when there are other ranks."""
        return self.group is not None

    def all_gather(self, obj: Any, what: str = "an all_gather") -> list[Any]:
        """Every rank's ``obj``, in rank order.

        Raises:
            RankLostError: another rank is gone or did not answer within the timeout.
        """
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with self._lost(what):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj: Any, dst: int, what: str = "a gather") -> list[Any] | None:
        """Every rank's ``obj`` on ``dst`` (in rank order); None on the other ranks.

        Raises:
            RankLostError: another rank is gone or did not answer within the timeout.
        """
        if self.group is None:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        with self._lost(what):
            dist.gather_object(
                obj, out, dst=dist.get_global_rank(self.group, dst), group=self.group
            )
        return out

    def broadcast(self, obj: Any, src: int = 0, what: str = "a broadcast") -> Any:
        """``src``'s ``obj`` on every rank.

        Raises:
            RankLostError: another rank is gone or did not answer within the timeout.
        """
        if self.group is None:
            return obj
        box = [obj if self.rank == src else None]
        with self._lost(what):
            dist.broadcast_object_list(
                box, src=dist.get_global_rank(self.group, src), group=self.group
            )
        return box[0]

    @contextlib.contextmanager
    def _lost(self, what: str) -> Any:
        """Turn the transport's failure (a closed connection, a timeout) into RankLostError."""
        try:
            yield
        except RuntimeError as e:  # gloo's errors (DistBackendError is a RuntimeError)
            cause = " ".join(str(e).split()).split(" This is typically")[0][:500]
            raise RankLostError(
                self.name, what, self.rank, self.world_size, self.timeout_s, cause
            ) from e

    def close(self) -> None:
        """Destroy the group (best effort; the default group may already be gone)."""
        if self.group is not None and dist.is_initialized():
            with contextlib.suppress(RuntimeError, ValueError):
                dist.destroy_process_group(self.group)
        self.group = None
