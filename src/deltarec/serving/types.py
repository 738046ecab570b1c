"""Records and errors of the serving replica: its position, its status, why it stopped.

Torch-free: the CLI reads these too. :class:`~deltarec.stores.ReplicaStatus` (``GET
/v1/status``) lives with the ``replica://`` store client, which reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltarec.errors import BadInputError, DeltarecError
from deltarec.ids import make_version


class ReplicaError(DeltarecError):
    """The replica cannot do what was asked (its message says what and where)."""


class SequenceError(ReplicaError):
    """A dump does not come next in the replica's generation: it refuses to apply it.

    Attributes:
        run, generation: the replica's generation.
        position: the last dump seq it applied.
        found: the seq of the dump it was offered (or found next in the outbox).
    """

    reason = "out of order"

    def __init__(self, run: str, generation: int, position: int, found: int, detail: str) -> None:
        self.run, self.generation, self.position, self.found = run, generation, position, found
        super().__init__(
            f"run {run!r} generation {generation}: replica at dump {position}, "
            f"offered dump {found} ({self.reason}): {detail}"
        )


class GapError(SequenceError):
    """A committed dump is missing: the next one in the outbox skips over it."""

    reason = "gap"

    @property
    def missing(self) -> int:
        """The seq of the first missing dump."""
        return self.position + 1


class DuplicateDumpError(SequenceError):
    """A dump already applied was offered again, or the outbox's copy is not the one applied."""

    reason = "duplicate"


class OutOfOrderError(SequenceError):
    """A dump older than the replica's position, or of another generation, was offered."""

    reason = "out of order"


class NotReadyError(ReplicaError):
    """The replica holds no generation yet (nothing promoted, or still loading)."""


class UnknownTableError(BadInputError):
    """A lookup named a table the replica does not hold."""

    def __init__(self, table: str, known: list[str]) -> None:
        self.table = table
        super().__init__(f"the replica holds no table {table!r}; it holds {known}")


@dataclass(frozen=True)
class Position:
    """A point of a run's lineage: ``generation`` through dump ``seq``."""

    run: str
    generation: int
    seq: int

    @property
    def version(self) -> int:
        """``generation << 32 | seq``."""
        return make_version(self.generation, self.seq)

    def describe(self) -> str:
        """``run 'demo' generation 2 dump 5``."""
        return f"run {self.run!r} generation {self.generation} dump {self.seq}"


__all__ = [
    "DuplicateDumpError",
    "GapError",
    "NotReadyError",
    "OutOfOrderError",
    "Position",
    "ReplicaError",
    "SequenceError",
    "UnknownTableError",
]
