"""Records and errors of the serving replica: its position, its status, why it stopped.

Torch-free: the HTTP client (:mod:`deltarec.serving.client`) and the CLI read these too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

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


@dataclass
class ReplicaStatus:
    """What a replica serves and how far behind it is (``GET /v1/status``).

    Attributes:
        run: the run it serves.
        ready: it holds a generation and answers lookups, and its run serves the store (what
            ``GET /readyz`` says).
        serves: whether its run serves the store (at least one table); None where the replica
            does not read who serves (a fixed pointer).
        serving: who serves the store: ``{describe, tables: {table: run}, runs: {run:
            {generation, seq}}}`` (None likewise).
        generation, seq, version: the point it serves (0 when not ready).
        pointer: the serving pointer it follows (``{generation, seq, promoted_at}``).
        shadow: the newer generation applied beside it, waiting for promote (or None).
        newest_seq: the newest committed dump of its generation in the outbox.
        lag_dumps: committed dumps of its generation it has not applied (following only).
        lag_s: seconds since the oldest of those was taken (0 when none).
        following: it applies its generation's new dumps as they are committed.
        blocked: why it refuses to advance (a gap, a duplicate), or None.
        error: the last round's failure that is not about a dump (the store unreachable, a
            promoted point the artifacts do not hold), or None.
        dense_step: the training step of the dense state it serves (None: no dense state).
        tables: table id -> ``{rows, dim, dtype, kind}``.
        applied_dumps: dumps applied since the process started.
        device: where its tables are (``cpu``, ``cuda:0``).
    """

    run: str
    ready: bool = False
    serves: bool | None = None
    serving: dict[str, Any] | None = None
    generation: int = 0
    seq: int = 0
    version: int = 0
    pointer: dict[str, Any] | None = None
    shadow: dict[str, int] | None = None
    newest_seq: int | None = None
    lag_dumps: int = 0
    lag_s: float = 0.0
    following: bool = False
    blocked: str | None = None
    error: str | None = None
    dense_step: int | None = None
    tables: dict[str, dict[str, Any]] = field(default_factory=dict)
    applied_dumps: int = 0
    device: str = "cpu"

    def to_json(self) -> dict[str, Any]:
        """The JSON object of ``GET /v1/status``."""
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> ReplicaStatus:
        """Parse ``GET /v1/status``; unknown fields are ignored."""
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in obj.items() if k in names})


__all__ = [
    "DuplicateDumpError",
    "GapError",
    "NotReadyError",
    "OutOfOrderError",
    "Position",
    "ReplicaError",
    "ReplicaStatus",
    "SequenceError",
    "UnknownTableError",
]
