"""What a serving replica says of itself and the bearer token its ``/v1/*`` API asks for.

Shared by the ``replica://`` store client (:mod:`deltarec.stores.replica.store`) and the replica
itself (``deltarec.serving``), which depends on the store layer, not the other way round. The
token is read from the environment only (``DELTAREC_REPLICA_TOKEN``, or a file named by
``DELTAREC_REPLICA_TOKEN_FILE``, e.g. a mounted Secret), never from a command line, where
``ps`` shows it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from deltarec.errors import ConfigError

TOKEN_ENV = "DELTAREC_REPLICA_TOKEN"
"""The environment variable holding the replica's bearer token."""
TOKEN_FILE_ENV = "DELTAREC_REPLICA_TOKEN_FILE"
"""The environment variable naming a file that holds the token (its first line)."""

_TOKEN = re.compile(r"[\x21-\x7e]{16,4096}")


def token_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The bearer token from :data:`TOKEN_ENV` or the file :data:`TOKEN_FILE_ENV` names.

    Returns:
        The token, or None when neither variable is set (no token: ``/v1/*`` is open).

    Raises:
        ConfigError: both are set, the file cannot be read, or the token is not 16 to 4096
            printable ASCII characters without spaces (the message never shows it).
    """
    env = os.environ if environ is None else environ
    value, path = env.get(TOKEN_ENV), env.get(TOKEN_FILE_ENV)
    if value and path:
        raise ConfigError(f"set one of {TOKEN_ENV} and {TOKEN_FILE_ENV}, not both")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                value = f.readline().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{TOKEN_FILE_ENV}={path}: cannot read the token: {e}") from e
    if not value:
        return None
    if not _TOKEN.fullmatch(value):
        where = TOKEN_FILE_ENV if path else TOKEN_ENV
        raise ConfigError(
            f"the replica token from {where} must be 16 to 4096 printable ASCII characters "
            f"without spaces (it holds {len(value)} characters)"
        )
    return value


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


__all__ = ["TOKEN_ENV", "TOKEN_FILE_ENV", "ReplicaStatus", "token_from_env"]
