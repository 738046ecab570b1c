"""Classify a batch of keys: expected records against what the store returned (vectorized).

The comparison is dtype-aware: encoded rows are decoded with :func:`codec.decode` and the
largest absolute difference is compared with :func:`codec.tolerance` of the expected values,
which is exactly 0 for ``float32`` (bit-for-bit after decoding), float16 rounding for
``float16``, and one quantization step for ``int8_rowwise``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from deltarec.artifacts import codec
from deltarec.artifacts.types import DType
from deltarec.ids import generations_of, make_version
from deltarec.verify.types import CLASS_ORDER, RowClass

CODE = {c: np.int8(i) for i, c in enumerate(CLASS_ORDER)}
"""RowClass -> its int8 code in :attr:`BatchOutcome.classes`."""

NO_RECORD = -1
"""Expected version of a key the lineage never wrote."""


@dataclass(frozen=True)
class Holds:
    """What a store keeps, as far as classifying its rows goes.

    Attributes:
        versions: rows carry their version. Without, a stored row is checked by its values
            only: MATCH within the dtype's tolerance, else DIFFERENT (a row of a newer dump
            cannot be told from a wrong row).
        deletes: an evicted key is removed. Without, an evicted key (``op = 1``) must hold the
            row its record carries (the fallback row of a ZCH id the model holds no row for,
            evicted or looked up but never admitted, as TorchEasyRec writes it) and is compared
            by value like a present key.
    """

    versions: bool = True
    deletes: bool = True

    @classmethod
    def of(cls, capabilities: Any) -> Holds:
        """From a store's :class:`~deltarec.stores.types.Capabilities`."""
        return cls(versions=bool(capabilities.versions), deletes=bool(capabilities.deletes))


@dataclass
class ExpectedBatch:
    """What serving must hold for a batch of keys.

    Attributes:
        keys: int64 [n].
        versions: int64 [n], the latest record's version, :data:`NO_RECORD` if none.
        present: bool [n], whether serving must hold the key.
        rows: [n, encoded_width] encoded rows (only read where ``present``).
    """

    keys: np.ndarray
    versions: np.ndarray
    present: np.ndarray
    rows: np.ndarray


@dataclass
class StoreBatch:
    """What the store returned for the same keys, in the same order.

    Attributes:
        found: bool [n].
        versions: int64 [n] (meaningless where not found).
        rows: [n, encoded_width] encoded rows (meaningless where not found).
    """

    found: np.ndarray
    versions: np.ndarray
    rows: np.ndarray


@dataclass
class BatchOutcome:
    """The classification of a batch.

    Attributes:
        classes: int8 [n], codes of :data:`CODE`.
        reasons: list of n short strings, only filled for non-MATCH keys ("" for MATCH).
        diffs: float32 [n], max abs difference where compared by value, NaN elsewhere.
        tolerance: float32 [n], the tolerance used where compared by value, NaN elsewhere.
    """

    classes: np.ndarray
    reasons: list[str]
    diffs: np.ndarray
    tolerance: np.ndarray


def max_abs_diff(expected: np.ndarray, stored: np.ndarray, dtype: DType, dim: int) -> np.ndarray:
    """Per-row max absolute difference of two encoded row batches, after decoding.

    NaN values (in either) give NaN, which no tolerance accepts.
    """
    if len(expected) == 0:
        return np.empty(0, np.float32)
    a = codec.decode(expected, dtype, dim)
    b = codec.decode(stored, dtype, dim)
    if dim == 0:
        return np.zeros(len(a), np.float32)
    d = np.abs(a - b)
    out = d.max(axis=1)
    nan = np.isnan(d).any(axis=1)
    if nan.any():
        out = out.astype(np.float32)
        out[nan] = np.nan
    return out.astype(np.float32, copy=False)


def classify(
    expected: ExpectedBatch,
    stored: StoreBatch,
    dtype: DType,
    dim: int,
    point_version: int,
    rollback_generations: frozenset[int] = frozenset(),
    holds: Holds = Holds(),
) -> BatchOutcome:
    """Classify every key of a batch (see :class:`~deltarec.verify.types.RowClass`).

    Args:
        expected: the expected records.
        stored: what the store holds for the same keys.
        dtype: the table's dtype.
        dim: the table's dim.
        point_version: the version of the newest dump verified; a store row of a key the
            lineage never wrote is SUPERSEDED if newer than this, UNEXPECTED otherwise.
        rollback_generations: generations that are rollbacks to exactly this point; their rows
            are compared by value against the expected rows instead of being SUPERSEDED.
        holds: what the store keeps (versions, deletes); see :class:`Holds`.
    """
    n = len(expected.keys)
    ev = np.asarray(expected.versions, np.int64)
    present = np.asarray(expected.present, bool)
    found = np.asarray(stored.found, bool)
    sv = np.where(found, np.asarray(stored.versions, np.int64), -1)
    threshold = np.where(ev == NO_RECORD, point_version, ev)
    by_rollback = np.zeros(n, bool)
    newer = np.zeros(n, bool)
    if holds.versions:
        if rollback_generations:
            gens = np.fromiter(rollback_generations, np.int64)
            by_rollback = found & (sv > threshold) & np.isin(generations_of(sv), gens)
        newer = found & (sv > threshold) & ~by_rollback
    # A key that must hold a row: present, or evicted on a store that cannot delete (its
    # record's row, the fallback row, was written in its place).
    fallback = ~present & (ev != NO_RECORD) if not holds.deletes else np.zeros(n, bool)
    must = present | fallback

    classes = np.full(n, CODE[RowClass.MATCH], np.int8)
    reasons = [""] * n
    diffs = np.full(n, np.nan, np.float32)
    tol = np.full(n, np.nan, np.float32)

    def mark(mask: np.ndarray, cls: RowClass, reason: str) -> None:
        classes[mask] = CODE[cls]
        for i in np.nonzero(mask)[0]:
            reasons[i] = reason

    # Expected absent.
    absent = ~must
    mark(absent & newer, RowClass.SUPERSEDED, "a newer version is in the store")
    mark(absent & found & ~newer & ~by_rollback, RowClass.UNEXPECTED, _absent_reason(ev))
    mark(absent & by_rollback, RowClass.UNEXPECTED, "a rollback should have removed it")
    # Expected present (or holding its fallback row).
    mark(present & ~found, RowClass.MISSING, "absent from the store")
    mark(fallback & ~found, RowClass.MISSING, "the fallback row of an op 1 (evicted) key is absent")
    mark(must & newer, RowClass.SUPERSEDED, "a newer version is in the store")
    if holds.versions:
        stale = must & found & ~newer & ~by_rollback & (sv < ev)
        mark(stale, RowClass.DIFFERENT, "stale version")
        compare = must & found & (by_rollback | (sv == ev))
    else:
        compare = must & found
    idx = np.nonzero(compare)[0]
    if len(idx):
        # Rows stored exactly as encoded (the normal case: nothing re-encodes on the way) are
        # equal without decoding; only the others are decoded and compared with tolerance.
        same = _same_rows(expected.rows, stored.rows, idx, n)
        diffs[idx[same]] = 0.0
        tol[idx[same]] = 0.0
        idx = idx[~same]
    if len(idx):
        d = max_abs_diff(expected.rows[idx], stored.rows[idx], dtype, dim)
        t = codec.tolerance(dtype, codec.decode(expected.rows[idx], dtype, dim))
        diffs[idx] = d
        tol[idx] = t
        bad = ~(d <= t)
        for j in idx[bad]:
            classes[j] = CODE[RowClass.DIFFERENT]
            if by_rollback[j]:
                reasons[j] = "rollback row differs from the expected values"
            elif fallback[j]:
                reasons[j] = (
                    "an op 1 key (evicted, or never admitted) must hold its fallback row; "
                    "values differ"
                )
            else:
                reasons[j] = "values differ"
    return BatchOutcome(classes, reasons, diffs, tol)


def _same_rows(expected: np.ndarray, stored: np.ndarray, idx: np.ndarray, n: int) -> np.ndarray:
    """Per row of ``idx``: whether the two encoded rows are equal element by element.

    When every row of the batch is compared (the usual batch), the whole batches are compared
    at once first, without gathering copies; only a batch with a difference is compared row
    by row.
    """
    if len(idx) == n and expected.shape == stored.shape and np.array_equal(expected, stored):
        return np.ones(n, bool)
    return np.asarray((expected[idx] == stored[idx]).all(axis=1))


def _absent_reason(ev: np.ndarray) -> str:
    # One reason for the whole batch keeps this vectorized; the mismatch record also carries
    # expected_version (None when the lineage never wrote the key).
    return "expected absent (evicted, removed, or never written)"


def point_of(generation: int, through_seq: int | None) -> int:
    """The version of a verification point (0 when the generation has no dump yet)."""
    return 0 if through_seq is None else make_version(generation, through_seq)
