"""How a verification reads: one frozen options object passed from :func:`verify` down.

:class:`VerifyOptions` holds what the sampling, batching and reporting of a verification need
(the seven settings that used to travel as keywords through four functions).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from deltarec.errors import BadInputError
from deltarec.verify.partition import Partition

DEFAULT_SAMPLE = 10_000
DEFAULT_BATCH = 8192
DEFAULT_LOAD_CHUNK = 1 << 20
DEFAULT_MAX_MISMATCHES = 20
DEFAULT_FULL_SCAN_BYTES = 1 << 30

ProgressFn = Callable[[str, int, int], None]
"""``progress(table, done, total)``, called after each store batch."""


@dataclass(frozen=True)
class VerifyOptions:
    """The settings of one verification.

    Attributes:
        sample: keys per table to sample; None (or 0, the same everywhere: ``--sample 0``,
            the pipeline's ``sample_size`` 0) checks every expected key and, where the store
            can list its keys, also finds keys the lineage never wrote (``--all``). A sample
            also compares each table's key count in the store with the expected state's
            (:mod:`deltarec.verify.count`).
        seed: the sampling seed (the same seed samples the same keys).
        batch_size: keys per store read.
        load_chunk: keys whose expected rows are loaded from the shards at once.
        max_mismatches: the worst non-MATCH keys kept per table.
        full_scan_bytes: with every key checked, a table whose expected rows fit in this many
            bytes is verified in one pass over the store (:meth:`Store.scan_rows`: each store
            row read once) against its expected rows streamed from the shards; larger tables,
            tables read through a staging view and stores that cannot list keys are read by
            key in chunks.
        progress: optional callback, see :data:`ProgressFn`.
        partition: check only this partition's key range of every table and its share of the
            shards (:mod:`deltarec.verify.partition`); None checks everything.
    """

    sample: int | None = DEFAULT_SAMPLE
    seed: int = 0
    batch_size: int = DEFAULT_BATCH
    load_chunk: int = DEFAULT_LOAD_CHUNK
    max_mismatches: int = DEFAULT_MAX_MISMATCHES
    full_scan_bytes: int = DEFAULT_FULL_SCAN_BYTES
    progress: ProgressFn | None = None
    partition: Partition | None = None

    def __post_init__(self) -> None:
        if self.sample is not None and self.sample < 0:
            raise BadInputError(f"sample size must be >= 0 (0: every key), got {self.sample}")
        if self.sample == 0:
            object.__setattr__(self, "sample", None)  # 0 means every key, in every command
        if self.batch_size < 1:
            raise BadInputError(f"batch size must be >= 1, got {self.batch_size}")
        if self.load_chunk < 1:
            raise BadInputError(f"load chunk must be >= 1, got {self.load_chunk}")

    @property
    def all_keys(self) -> bool:
        """Whether every expected key is checked (``--all``)."""
        return self.sample is None

    def with_fields(self, **changes: Any) -> VerifyOptions:
        """A copy with ``changes``; an unknown name is a :class:`BadInputError` naming it."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise BadInputError(f"unknown verify option(s) {unknown}; known: {sorted(known)}")
        return replace(self, **changes)


__all__ = [
    "DEFAULT_BATCH",
    "DEFAULT_FULL_SCAN_BYTES",
    "DEFAULT_MAX_MISMATCHES",
    "DEFAULT_SAMPLE",
    "ProgressFn",
    "VerifyOptions",
]
