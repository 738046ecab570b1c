"""Promote and roll back a store named by URL.

The use cases behind ``deltarec promote`` and ``deltarec rollback``; the pipeline's promote and
rollback steps call the same functions.
"""

from __future__ import annotations

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.history import RunHistory
from deltarec.promote.promote import PromoteResult
from deltarec.promote.promote import promote as promote_store
from deltarec.promote.rollback import RollbackResult
from deltarec.promote.rollback import rollback as rollback_store
from deltarec.stores import open_store

__all__ = ["promote_generation", "rollback"]


def promote_generation(
    artifacts: str,
    run: str,
    store_url: str,
    generation: int,
    *,
    through_seq: int | None = None,
    force: bool = False,
) -> PromoteResult:
    """Promote ``generation`` through ``through_seq`` (default: its newest dump)."""
    with open_store(store_url, artifacts, run=run) as store:
        return promote_store(
            RunHistory(ArtifactRoot(artifacts)),
            run,
            store,
            generation,
            through_seq=through_seq,
            force=force,
        )


def rollback(
    artifacts: str,
    run: str,
    store_url: str,
    to_generation: int,
    through_seq: int | None = None,
    *,
    sample: int | None = None,
) -> RollbackResult:
    """Restore serving to ``to_generation`` (default: at the dump it was last promoted at).

    Verifies the store against that point afterwards (every key unless ``sample``).

    Raises:
        RollbackCheckError: the store does not equal the point afterwards.
    """
    with open_store(store_url, artifacts, run=run) as store:
        return rollback_store(
            RunHistory(ArtifactRoot(artifacts)), run, store, to_generation, through_seq=through_seq,
            sample=sample,
        )  # fmt: skip
