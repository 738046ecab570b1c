"""Run a verification against a store named by URL: the use case behind ``deltarec verify``.

:func:`run_verification` opens the store, calls :func:`deltarec.verify.verify` and leaves the
verification record promote requires. The CLI and the pipeline's verify step both call it.
"""

from __future__ import annotations

import logging

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.history import RunHistory
from deltarec.stores import open_store
from deltarec.verify.engine import verify as verify_store
from deltarec.verify.options import DEFAULT_BATCH, DEFAULT_MAX_MISMATCHES, ProgressFn, VerifyOptions
from deltarec.verify.partition import Partition
from deltarec.verify.records import write_record as write_verification
from deltarec.verify.types import VerifyResult

__all__ = ["keep_record", "run_verification", "verify_url"]

log = logging.getLogger(__name__)


def run_verification(
    artifacts: str,
    run: str,
    store_url: str,
    *,
    generation: int | None = None,
    through_seq: int | None = None,
    sample: int | None = None,
    seed: int = 0,
    batch_size: int = DEFAULT_BATCH,
    max_mismatches: int = DEFAULT_MAX_MISMATCHES,
    record: bool = True,
    progress: ProgressFn | None = None,
    partition: Partition | None = None,
) -> VerifyResult:
    """Verify a generation through a dump against the store; leaves the verification record.

    ``sample=None`` checks every key and scans the store for keys the lineage never wrote.
    The record (which promote requires) is written unless ``record`` is False. ``partition``
    checks only that partition's share (:mod:`deltarec.verify.partition`).
    """
    root = RunHistory(ArtifactRoot(artifacts))  # read once for the whole verification
    options = VerifyOptions(
        sample=sample,
        seed=seed,
        batch_size=batch_size,
        max_mismatches=max_mismatches,
        progress=progress,
        partition=partition,
    )
    result = verify_url(root, run, store_url, options, generation, through_seq)
    if record:
        keep_record(root, result)
    return result


def keep_record(root: ArtifactRoot, result: VerifyResult) -> None:
    """Write the verification record of ``result`` under ``root`` and log where it is."""
    path = write_verification(root, result)
    if path:
        log.info("verification record: %s", root.url(path))


def verify_url(
    root: ArtifactRoot,
    run: str,
    store_url: str,
    options: VerifyOptions,
    generation: int | None = None,
    through_seq: int | None = None,
) -> VerifyResult:
    """Open the store named by ``store_url``, verify it with ``options`` and close it again.

    The result names the store without credentials (``Store.describe``). No record is written.
    """
    with open_store(store_url, root.uri, run=run) as store:
        return verify_store(
            root,
            run,
            store,
            options,
            store_url=store.describe(),
            generation=generation,
            through_seq=through_seq,
        )
