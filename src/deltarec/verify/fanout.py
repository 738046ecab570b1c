"""Verify fanned out: one partition against a store named by URL, and the gate that combines.

:func:`verify_partition` checks partition ``I/N`` (:mod:`deltarec.verify.partition`) and leaves
no verification record; :func:`combine_partitions` combines the ``N`` results into one, equal to
a single verification of every key, and writes the record promote requires. ``deltarec verify
--partition`` / ``--combine`` and the pipelines' fanned-out verify call these.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from deltarec.artifacts import ArtifactRoot
from deltarec.verify.options import DEFAULT_BATCH, DEFAULT_MAX_MISMATCHES, ProgressFn, VerifyOptions
from deltarec.verify.partition import Partition, combine
from deltarec.verify.records import write_record
from deltarec.verify.run import verify_url
from deltarec.verify.types import VerifyResult

__all__ = ["combine_partitions", "verify_partition"]

log = logging.getLogger(__name__)


def verify_partition(
    artifacts: str,
    run: str,
    store_url: str,
    partition: Partition,
    *,
    generation: int | None = None,
    through_seq: int | None = None,
    sample: int | None = None,
    seed: int = 0,
    batch_size: int = DEFAULT_BATCH,
    max_mismatches: int = DEFAULT_MAX_MISMATCHES,
    progress: ProgressFn | None = None,
) -> VerifyResult:
    """Verify partition ``partition`` of a generation through a dump against the store.

    The arguments are those of a whole verification (``sample=None``: every key of the
    partition's ranges, and the store keys in them the lineage never wrote). No record is
    written: a partition proves only its share.
    """
    options = VerifyOptions(
        sample=sample,
        seed=seed,
        batch_size=batch_size,
        max_mismatches=max_mismatches,
        progress=progress,
        partition=partition,
    )
    return verify_url(ArtifactRoot(artifacts), run, store_url, options, generation, through_seq)


def combine_partitions(
    artifacts: str,
    results: Sequence[VerifyResult],
    *,
    max_mismatches: int = DEFAULT_MAX_MISMATCHES,
    record: bool = True,
) -> VerifyResult:
    """The gate: combine partitions ``0..N-1`` into one result and write its record.

    Raises:
        BadInputError: the results are not exactly the partitions of one verification.
    """
    result = combine(results, max_mismatches)
    if record:
        root = ArtifactRoot(artifacts)
        path = write_record(root, result)
        if path:
            log.info("verification record: %s", root.url(path))
    return result
