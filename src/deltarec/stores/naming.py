"""Physical names of store views (SPEC §5, docs/runs.md) and safe SQL identifiers.

A table id ``sparse.ebc.user_id`` has the **serving name** ``emb_sparse_ebc_user_id``: the
prefix, then the id lower-cased with every character outside ``[a-z0-9_]`` replaced by ``_``.
Each run keeps its rows in a view of its own, ``emb_<run>__sparse_ebc_user_id`` (the run mapped
the same way), and the serving name reads the promoted run's view (docs/runs.md). Names longer
than 63 characters (PostgreSQL's limit) are cut and given a short hash of what they name, so two
long ids stay distinct. Every identifier that reaches SQL passes :func:`check_identifier`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

from deltarec.errors import BadInputError, InvalidIdentifierError
from deltarec.ids import validate_run, validate_table_id

MAX_IDENTIFIER = 63
"""PostgreSQL's identifier limit; SQLite has none but uses the same names."""

_IDENT_RE = re.compile(r"^[a-z_][a-z0-9_]*$")
_IDENT_DESC = "lower-case letters, digits and '_' (not starting with a digit, at most 63)"
_PREFIX_RE = re.compile(r"^[a-z_][a-z0-9_]*$|^$")
_KV_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.:{}-]*$")
_UNSAFE = re.compile(r"[^a-z0-9_]")
_HASH_LEN = 8


def check_identifier(name: str, kind: str = "SQL identifier") -> str:
    """Return ``name`` if it is a safe, unquoted-compatible SQL identifier.

    Raises:
        InvalidIdentifierError: naming ``kind`` and the value.
    """
    if not isinstance(name, str) or len(name) > MAX_IDENTIFIER or not _IDENT_RE.match(name):
        raise InvalidIdentifierError(kind, str(name), _IDENT_DESC)
    return name


def quote(name: str) -> str:
    """``"name"`` after :func:`check_identifier` (quoting keeps reserved words safe)."""
    return f'"{check_identifier(name)}"'


def check_prefix(prefix: str) -> str:
    """Validate a view name prefix of a relational store (may be empty)."""
    if len(prefix) > MAX_IDENTIFIER - _HASH_LEN - 2 or not _PREFIX_RE.match(prefix):
        raise InvalidIdentifierError("view prefix", prefix, _IDENT_DESC)
    return prefix


def check_kv_prefix(prefix: str) -> str:
    """Validate a key prefix of a key-value store (Redis)."""
    if len(prefix) > 200 or not _KV_PREFIX_RE.match(prefix):
        raise InvalidIdentifierError("key prefix", prefix, "[A-Za-z0-9_.:{}-]")
    return prefix


def view_name(table: str, prefix: str = "emb_") -> str:
    """The serving name of ``table`` (SPEC §5), a checked SQL identifier."""
    validate_table_id(table)
    return _cut(prefix + _UNSAFE.sub("_", table.lower()), table, f"view name of table {table!r}")


def run_view_name(run: str, table: str, prefix: str = "emb_") -> str:
    """The name of run ``run``'s own view of ``table``: ``<prefix><run>__<table>``, checked."""
    validate_run(run)
    validate_table_id(table)
    name = f"{prefix}{_UNSAFE.sub('_', run.lower())}__{_UNSAFE.sub('_', table.lower())}"
    return _cut(name, f"{run}\0{table}", f"view name of table {table!r} of run {run!r}")


def _cut(name: str, named: str, kind: str) -> str:
    """``name``, cut to 63 characters with a hash of ``named`` where it is longer."""
    if len(name) > MAX_IDENTIFIER:
        digest = hashlib.sha256(named.encode()).hexdigest()[:_HASH_LEN]
        name = f"{name[: MAX_IDENTIFIER - _HASH_LEN - 1]}_{digest}"
    return check_identifier(name, kind)


def staging_prefix(prefix: str, generation: int) -> str:
    """The prefix of generation ``generation``'s staging views, e.g. ``emb_stage7_``."""
    return f"{prefix}stage{int(generation)}_"


def view_names(
    tables: Iterable[str], prefix: str = "emb_", run: str | None = None
) -> dict[str, str]:
    """Map table ids to view names (serving names, or ``run``'s own views).

    Raises:
        BadInputError: two ids map to one name.
    """
    names: dict[str, str] = {}
    owner: dict[str, str] = {}
    for table in tables:
        name = view_name(table, prefix) if run is None else run_view_name(run, table, prefix)
        if name in owner and owner[name] != table:
            raise BadInputError(
                f"tables {owner[name]!r} and {table!r} both map to the view name {name!r}; "
                "rename one of them or use another prefix"
            )
        owner[name] = table
        names[table] = name
    return names
