"""Errors of the training loop (all :class:`~deltarec.errors.DeltarecError` subclasses)."""

from __future__ import annotations

from typing import Any

from deltarec.errors import DeltarecError


class TrainError(DeltarecError):
    """Training failed for a reason the user must act on."""


class DataExhaustedError(TrainError):
    """Some ranks ran out of data while others still had batches; raised on EVERY rank.

    Attributes:
        step: the training step (1-based) that could not run.
        exhausted_ranks: the ranks that had no batch for ``step``.
        world_size: number of ranks.
    """

    def __init__(self, step: int, exhausted_ranks: list[int], world_size: int) -> None:
        self.step = step
        self.exhausted_ranks = list(exhausted_ranks)
        self.world_size = world_size
        ranks = ", ".join(str(r) for r in self.exhausted_ranks)
        super().__init__(
            f"data exhausted unevenly at step {step}: rank(s) {ranks} of {world_size} have no "
            "batch while the others still do; every rank must have the same number of batches"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (DataExhaustedError, (self.step, self.exhausted_ranks, self.world_size))


class CheckpointError(TrainError):
    """A training checkpoint could not be saved or restored."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"checkpoint {path}: {problem}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (CheckpointError, (self.path, self.problem))
