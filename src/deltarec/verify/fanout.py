"""Verify fanned out: one partition against a store named by URL, and the gate that combines.

:func:`verify_partition` checks partition ``I/N`` (:mod:`deltarec.verify.partition`) and leaves
no verification record; :func:`combine_partitions` combines the ``N`` results into one, equal to
a single verification of every key, and writes the record promote requires. ``deltarec verify
--partition`` / ``--combine`` and the pipelines' fanned-out verify call these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deltarec.artifacts import ArtifactRoot
from deltarec.verify.options import DEFAULT_MAX_MISMATCHES
from deltarec.verify.partition import Partition, combine
from deltarec.verify.run import keep_record, run_verification
from deltarec.verify.types import VerifyResult

__all__ = ["combine_partitions", "verify_partition"]


def verify_partition(
    artifacts: str, run: str, store_url: str, partition: Partition, **options: Any
) -> VerifyResult:
    """Verify partition ``partition`` of a generation through a dump against the store.

    ``options`` are the keyword arguments of a whole verification
    (:func:`~deltarec.verify.run.run_verification`: ``generation``, ``through_seq``,
    ``sample``, ...; ``sample=None``: every key of the partition's ranges, and the store keys
    in them the lineage never wrote). No record is written: a partition proves only its share.
    """
    return run_verification(artifacts, run, store_url, **options, partition=partition, record=False)


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
        keep_record(ArtifactRoot(artifacts), result)
    return result
