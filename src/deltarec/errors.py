"""The deltarec error hierarchy.

Every error deltarec raises on purpose derives from :class:`DeltarecError`. Subclasses build
their message from the facts (what, where, expected vs found) so a user can act on it. The CLI
maps :class:`BadInputError` (and its subclasses) to exit code 2 and :class:`CheckFailedError` to
exit code 1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class DeltarecError(Exception):
    """Base class of every error deltarec raises on purpose."""


class BadInputError(DeltarecError):
    """Input (config, URI, artifact, identifier, row) is invalid. CLI exit code 2."""


class ConfigError(BadInputError):
    """A configuration value or combination of values is invalid."""


def validation_problems(error: Any, name: Callable[[tuple[Any, ...]], str] | None = None) -> str:
    """A pydantic ``ValidationError`` as one line: ``where: what; ...``.

    Unlike ``str(error)`` it carries no input dumps and no "For further information visit ..."
    lines. ``name`` maps an error's location to how the user spells it (a flag, a variable);
    the default joins the location with dots. An unknown field reads ``unknown option 'x'``.
    """
    parts = []
    for err in error.errors():
        loc = tuple(p for p in err.get("loc", ()) if p != "")
        where = name(loc) if name is not None else ".".join(str(p) for p in loc)
        if err.get("type") == "extra_forbidden":
            parts.append(f"unknown option {where!r}")
        else:
            parts.append(f"{where or 'settings'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)


class ArtifactError(BadInputError):
    """An artifact under the artifact root is missing, malformed or corrupted."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"{path}: {problem}")


class SchemaVersionError(ArtifactError):
    """An artifact declares a ``schema_version`` this reader does not understand."""

    def __init__(self, path: str, found: object, supported: int) -> None:
        self.found = found
        self.supported = supported
        super().__init__(
            path,
            f"unknown schema_version {found!r} (this deltarec reads schema_version {supported})",
        )


class MissingDumpError(BadInputError):
    """A committed dump is missing from a generation's chain (SPEC §3a) and no base covers it.

    Within a generation committed dumps have consecutive seqs after the newest base that covers
    it; a hole means a dump was lost, and every reader refuses rather than serve without it.
    """

    def __init__(self, where: str, run: str, generation: int, seq: int, detail: str) -> None:
        self.run = run
        self.generation = generation
        self.seq = seq
        super().__init__(
            f"{where}: run {run!r} generation {generation}: dump {seq} is missing (a gap in "
            f"the chain of committed dumps; {detail})"
        )


class ChecksumError(ArtifactError):
    """A shard's sha256 or row count does not match its manifest."""


class InvalidIdentifierError(BadInputError):
    """A run name, table id or SQL identifier contains characters that are not allowed."""

    def __init__(self, kind: str, value: str, allowed: str) -> None:
        self.kind = kind
        self.value = value
        super().__init__(f"invalid {kind} {value!r}: only {allowed} are allowed")


class InvalidRowError(BadInputError):
    """A row cannot be published: NaN/Inf values, wrong dim, bad key. Never retried."""

    def __init__(self, table: str, where: str, key: int | None, problem: str) -> None:
        self.table = table
        self.where = where
        self.key = key
        at = f" key {key}" if key is not None else ""
        super().__init__(f"table {table!r}{at} in {where}: {problem}")


class StoreError(DeltarecError):
    """A store operation failed for a reason that retrying will not fix."""


class StaleGenerationError(StoreError):
    """A write from a generation older than the newest the store has seen for its run.

    One writer per run (SPEC §5): once a newer generation registered, the older one's rows and
    marks are refused. Never retried.
    """

    def __init__(self, store: str, run: str, generation: int, newest: int) -> None:
        self.run = run
        self.generation = generation
        self.newest = newest
        super().__init__(
            f"{store}: refused a write of run {run!r} generation {generation}: the store has "
            f"seen generation {newest} of the run, which superseded it"
        )


class StoreUnavailableError(StoreError):
    """A store could not be reached (connection refused/reset, timeout). Retried with backoff."""


class UnsupportedError(BadInputError, NotImplementedError):
    """A store cannot do what was asked (e.g. staging views on PAI FeatureStore); names it."""


class ViewMismatchError(BadInputError):
    """An existing store view has another dim or dtype than the tables to provision."""

    def __init__(self, view: str, existing: str, wanted: str) -> None:
        super().__init__(f"view {view!r} exists as {existing}, but the tables need {wanted}")


class CheckFailedError(DeltarecError):
    """A verification found mismatches. CLI exit code 1."""


class DumpError(DeltarecError):
    """A dump failed (raised on the training thread at the next dumper call)."""

    def __init__(self, run: str, generation: int, seq: int, table: str | None, problem: str):
        self.run = run
        self.generation = generation
        self.seq = seq
        self.table = table
        where = f"run {run!r} generation {generation} dump {seq}"
        if table is not None:
            where += f" table {table!r}"
        super().__init__(f"{where}: {problem}")
