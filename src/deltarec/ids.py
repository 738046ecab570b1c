"""Identifiers and versions (SPEC §2, §3).

A **version** is ``generation << 32 | seq``: an int64 that orders every dump of a run totally,
across restarts. Run names and table ids are restricted to ``[A-Za-z0-9_.-]`` so they can be
used as path components and (after mapping) as SQL identifiers.
"""

from __future__ import annotations

import re

import numpy as np

from deltarec.errors import InvalidIdentifierError

SCHEMA_VERSION = 1
"""The artifact ``schema_version`` this deltarec writes and reads."""

_SEQ_BITS = 32
_SEQ_MASK = (1 << _SEQ_BITS) - 1
_MAX_GENERATION = (1 << 31) - 1
_SAFE_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_SAFE_DESC = "the characters [A-Za-z0-9_.-]"


def make_version(generation: int, seq: int) -> int:
    """Pack a generation (>= 1) and a dump seq (>= 0) into one int64 version.

    Raises:
        ValueError: if either part is out of range.
    """
    if not 1 <= generation <= _MAX_GENERATION:
        raise ValueError(f"generation {generation} out of range [1, {_MAX_GENERATION}]")
    if not 0 <= seq <= _SEQ_MASK:
        raise ValueError(f"dump seq {seq} out of range [0, {_SEQ_MASK}]")
    return (generation << _SEQ_BITS) | seq


def split_version(version: int) -> tuple[int, int]:
    """Return ``(generation, seq)`` of a version made by :func:`make_version`."""
    if version < 0:
        raise ValueError(f"version {version} is negative")
    return version >> _SEQ_BITS, version & _SEQ_MASK


def generations_of(versions: np.ndarray) -> np.ndarray:
    """The generation of each version of an int64 array (:func:`split_version`, vectorized)."""
    return np.asarray(versions, np.int64) >> _SEQ_BITS


def validate_table_id(table: str) -> str:
    """Return ``table`` if it is a valid table id, else raise :class:`InvalidIdentifierError`."""
    # "." and ".." are made of allowed characters but name a directory, not a table's own one
    if not isinstance(table, str) or not _SAFE_RE.match(table) or table in {".", ".."}:
        raise InvalidIdentifierError("table id", str(table), _SAFE_DESC)
    return table


def validate_run(run: str) -> str:
    """Return ``run`` if it is a valid run name, else raise :class:`InvalidIdentifierError`."""
    if not isinstance(run, str) or not _SAFE_RE.match(run) or run in {".", ".."}:
        raise InvalidIdentifierError("run name", str(run), _SAFE_DESC)
    return run


def table_id(module_fqn: str, table_name: str) -> str:
    """Build a table id from the owning module's FQN (DMP prefixes stripped) and a table name.

    ``module_fqn`` may still start with DistributedModelParallel wrapper prefixes (``module.``,
    ``_dmp_wrapped_module.``); they are removed so the id is stable across wrapping.
    """
    parts = [p for p in module_fqn.split(".") if p]
    while parts and parts[0] in _WRAPPER_PARTS:
        parts.pop(0)
    return validate_table_id(".".join([*parts, table_name]))


_WRAPPER_PARTS = frozenset({"module", "_dmp_wrapped_module", "_orig_mod"})
