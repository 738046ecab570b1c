"""Promote: make a verified generation serving's current one (SPEC §7).

Promotion is a registry operation: the store's serving pointer is set to the generation
through a dump (:meth:`Store.set_serving`, kept in a history). A generation published in
``staged`` mode is first made live by :meth:`Store.merge_staging` (one transaction where the
backend can). Promotion requires a passing verification record of exactly that generation,
dump and store (:mod:`deltarec.verify.records`: bound to the store's identity, not its URL);
``force`` overrides, and the pointer's note
says so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from deltarec.artifacts.root import ArtifactRoot
from deltarec.errors import BadInputError, CheckFailedError
from deltarec.stores.base import Store
from deltarec.stores.types import ServingPointer
from deltarec.verify.records import VerificationRecord, read_record

log = logging.getLogger(__name__)


class NotVerifiedError(CheckFailedError):
    """Promotion refused: the generation has no passing verification against this store."""

    def __init__(
        self, run: str, generation: int, seq: int, store: str, record: VerificationRecord | None
    ) -> None:
        self.record = record
        what = f"run {run!r} generation {generation} through dump {seq}"
        if record is None:
            why = f"was never verified against {store}"
        else:
            why = f"failed verification against {store} at {record.recorded_at}: {record.failure}"
        super().__init__(
            f"{what} {why}; run `deltarec verify --generation {generation} --through-seq {seq}` "
            "first, or promote with --force"
        )


@dataclass(frozen=True)
class PromoteResult:
    """What a promotion did.

    Attributes:
        pointer: the serving pointer now in the store's registry.
        verified: a passing verification record was found.
        forced: promoted with ``force`` although not verified.
        merged_rows: rows merged from staging into live (0 for a direct-mode generation).
        record_path: the verification record used (None when forced without one).
    """

    pointer: ServingPointer
    verified: bool
    forced: bool
    merged_rows: int
    record_path: str | None


def resolve_seq(root: ArtifactRoot, run: str, generation: int, through_seq: int | None) -> int:
    """``through_seq`` checked against the generation's committed dumps, or its newest one.

    Raises:
        BadInputError: no such generation or dump, or the generation has no committed dump.
    """
    if generation not in root.list_generations(run):
        raise BadInputError(
            f"run {run!r} has no generation {generation} under {root.uri} "
            f"(generations: {root.list_generations(run)})"
        )
    dumps = root.list_dumps(run, generation)
    if not dumps:
        raise BadInputError(f"run {run!r} generation {generation} has no committed dump")
    if through_seq is None:
        return dumps[-1]
    if through_seq not in dumps:
        raise BadInputError(
            f"run {run!r} generation {generation} has no committed dump {through_seq} "
            f"(committed: {dumps})"
        )
    return through_seq


def is_staged(store: Store, run: str, generation: int) -> bool:
    """Whether ``generation`` published (some of) its rows into staging views of ``store``."""
    if not store.capabilities.staging:
        return False
    return any(m.staging_generation == generation for m in store.registry.progress(run, generation))


def promote(
    root: ArtifactRoot,
    run: str,
    store: Store,
    generation: int,
    through_seq: int | None = None,
    force: bool = False,
) -> PromoteResult:
    """Make ``generation`` through dump ``through_seq`` (default: its newest) serving's current.

    Idempotent: promoting the same point again merges nothing new and appends the same pointer
    to the history.

    Raises:
        BadInputError: no such generation or dump.
        NotVerifiedError: no passing verification record and not ``force``.
    """
    seq = resolve_seq(root, run, generation, through_seq)
    record = read_record(root, run, generation, seq, store)
    verified = record is not None and record.passed
    if not verified and not force:
        raise NotVerifiedError(run, generation, seq, store.describe(), record)
    merged = 0
    if is_staged(store, run, generation):
        merged = store.merge_staging(run, generation)
        log.info("merged %d staged rows of generation %d into live", merged, generation)
    if verified:
        assert record is not None
        note = f"promoted; verified {record.recorded_at}"
    elif record is None:
        note = "promoted with --force; never verified"
    else:
        note = f"promoted with --force; verification failed {record.recorded_at}"
    store.registry.register_generation(run, generation)
    pointer = store.registry.set_serving(run, generation, seq, note=note)
    return PromoteResult(
        pointer=pointer,
        verified=verified,
        forced=not verified,
        merged_rows=merged,
        record_path=record.path if record else None,
    )
