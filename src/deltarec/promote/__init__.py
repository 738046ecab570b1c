"""Promote and rollback (SPEC §7): move serving between verified generations.

Exports:
    promote, PromoteResult, NotVerifiedError: record a verified generation (through a dump) as
        serving's current one; merge staging first in staged mode.
    rollback, RollbackResult, RollbackCheckError: make a run's views equal a promoted point's
        expected state (a snapshot of it at a new version, through a new generation in the
        artifact root), serve them, and verify the store against the point.
    who_serves, Serving: who serves a store (the run per table, and its pointer).
    changed_after, check_point, promoted_seq, resolve_seq, is_staged: the steps, for tools
        and tests.
"""

from deltarec.promote.promote import (
    NotVerifiedError,
    PromoteResult,
    is_staged,
    promote,
    resolve_seq,
)
from deltarec.promote.rollback import (
    RollbackCheckError,
    RollbackResult,
    changed_after,
    check_point,
    promoted_seq,
    rollback,
)
from deltarec.stores import Serving, who_serves

__all__ = [
    "NotVerifiedError",
    "PromoteResult",
    "RollbackCheckError",
    "RollbackResult",
    "Serving",
    "changed_after",
    "check_point",
    "is_staged",
    "promote",
    "promoted_seq",
    "resolve_seq",
    "rollback",
    "who_serves",
]
