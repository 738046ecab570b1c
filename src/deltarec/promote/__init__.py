"""Promote and rollback (SPEC §7): move serving between verified generations.

Exports:
    promote, PromoteResult, NotVerifiedError: record a verified generation (through a dump) as
        serving's current one; merge staging first in staged mode.
    rollback, RollbackResult: restore every key changed after a promoted point, at a new
        version, through a new generation in the artifact root.
    keys_changed_after, restore_rows, promoted_seq, resolve_seq, is_staged: the
        steps, for tools and tests.
"""

from deltarec.promote.promote import (
    NotVerifiedError,
    PromoteResult,
    is_staged,
    promote,
    resolve_seq,
)
from deltarec.promote.rollback import (
    RollbackResult,
    keys_changed_after,
    promoted_seq,
    restore_rows,
    rollback,
)

__all__ = [
    "NotVerifiedError",
    "PromoteResult",
    "RollbackResult",
    "is_staged",
    "keys_changed_after",
    "promote",
    "promoted_seq",
    "resolve_seq",
    "restore_rows",
    "rollback",
]
