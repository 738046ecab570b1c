"""The hook interface between the training loop and deltarec's training-side services.

The loop in :mod:`deltarec.train` calls every hook at fixed points; the dumper (and the
publisher behind it) attach through this interface so the loop never imports them directly.
Hooks must keep ``after_step`` cheap: no collective operation, no blocking I/O.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class TrainHook(Protocol):
    """What the training loop calls. All methods run on the training thread of every rank."""

    def on_start(self, model: torch.nn.Module, step: int, restored_from: int | None) -> None:
        """Training begins at ``step``; ``restored_from`` is the checkpoint step, if any.

        Called after :meth:`load_state_dict` when resuming from a checkpoint.
        """

    def after_step(self, step: int) -> None:
        """A training step (forward, backward, optimizer) finished; ``step`` counts from 1.

        Called before that step's evaluation and checkpoint (if any fall on ``step``).
        """

    def before_eval(self) -> None:
        """Evaluation begins: lookups until :meth:`after_eval` are not training updates."""

    def after_eval(self) -> None:
        """Evaluation ended."""

    def on_end(self, step: int) -> None:
        """Training finished normally at ``step`` (the final dump happens here).

        Called after the final checkpoint and before the table export. Also called when every
        rank ran out of data at the same step (``step`` is then below the configured steps).
        """

    def before_checkpoint(self) -> None:
        """A checkpoint of this step is about to be written; raise to veto it.

        Called on every rank before :meth:`state_dict`. The dump hook waits here until every
        queued dump is committed and raises when a newer trainer owns the run, so a superseded
        trainer writes no checkpoint. Hooks with nothing to do return at once.
        """

    def close(self) -> None:
        """Release everything; called on every exit path, also after an exception."""

    def state_dict(self) -> dict[str, Any]:
        """State saved in the training checkpoint.

        Called on every rank at each checkpoint, after :meth:`after_step` of that step. Each
        rank's state is saved and restored separately (it may differ between ranks); it is
        serialized with ``torch.save``.
        """

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state from a training checkpoint (before :meth:`on_start`)."""
