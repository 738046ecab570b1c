"""Readback verification (SPEC §7): prove that a store holds what the artifacts say.

:func:`verify` compares a store with the expected state of a generation through a dump,
checks every shard's sha256 and row count, and classifies each checked key as MATCH,
DIFFERENT, MISSING, UNEXPECTED or SUPERSEDED. DIFFERENT, MISSING, UNEXPECTED, a shard that
fails its checksum and an artifact that cannot be read fail the check; SUPERSEDED does not.

Exports:
    verify: run a verification, returns a :class:`VerifyResult`.
    VerifyOptions: how it samples, batches and reports.
    VerifyResult, TableResult, Mismatch, ShardFailure, DumpFreshness, RowClass,
    FAILING_CLASSES: the result records.
    to_json, dumps_json, kfp_metrics: machine outputs (stable JSON schema, KFP metrics).
    print_summary, render_html: human outputs (rich table, self-contained HTML page).
    write_record, read_record, VerificationRecord: the records promote relies on.
"""

from deltarec.verify.engine import verify
from deltarec.verify.options import VerifyOptions
from deltarec.verify.output import dumps_json, kfp_metrics, to_json
from deltarec.verify.records import VerificationRecord, read_record, write_record
from deltarec.verify.report import print_summary, render_html
from deltarec.verify.types import (
    FAILING_CLASSES,
    DumpFreshness,
    Mismatch,
    RowClass,
    ShardFailure,
    TableResult,
    VerifyResult,
)

__all__ = [
    "FAILING_CLASSES",
    "DumpFreshness",
    "Mismatch",
    "RowClass",
    "ShardFailure",
    "TableResult",
    "VerificationRecord",
    "VerifyOptions",
    "VerifyResult",
    "dumps_json",
    "kfp_metrics",
    "print_summary",
    "read_record",
    "render_html",
    "to_json",
    "verify",
    "write_record",
]
