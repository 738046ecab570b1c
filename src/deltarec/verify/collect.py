"""Accumulating one table's classification: counts, the worst mismatches, live versions."""

from __future__ import annotations

import numpy as np

from deltarec.artifacts.types import DType
from deltarec.ids import split_version
from deltarec.verify.compare import (
    CODE,
    NO_RECORD,
    BatchOutcome,
    ExpectedBatch,
    Holds,
    StoreBatch,
    classify,
)
from deltarec.verify.reader import LaterDeletes
from deltarec.verify.types import CLASS_ORDER, Mismatch, RowClass, TableResult

_DEFAULT = Holds()


class Collector:
    """Accumulates counts, the worst mismatches and live versions of one table.

    Args:
        res: the table's result, updated in place.
        limit: the worst non-MATCH keys kept.
        later: deletes by dumps newer than the point (a MISSING key they deleted is SUPERSEDED).
        holds: what the store keeps (versions, deletes), see :class:`Holds`.
    """

    def __init__(
        self, res: TableResult, limit: int, later: LaterDeletes, holds: Holds = _DEFAULT
    ) -> None:
        self.res = res
        self.limit = limit
        self.later = later
        self.holds = holds
        self.dtype = DType(res.dtype)

    def add(
        self,
        exp: ExpectedBatch,
        got: StoreBatch,
        point_version: int,
        rollbacks: frozenset[int],
    ) -> None:
        """Classify a batch of expected records against the store's rows and count it."""
        dim = self.res.dim
        out = classify(
            exp,
            got,
            self.dtype,
            dim,
            point_version,
            rollbacks,
            self.holds,
        )
        if self.holds.versions:
            self._newer_of_the_lineage(exp, got, out)
        missing = np.nonzero(out.classes == CODE[RowClass.MISSING])[0]
        if len(missing):
            for i in missing[self.later.mask(self.res.table, exp.keys[missing])]:
                out.classes[i] = CODE[RowClass.SUPERSEDED]
                out.reasons[i] = "deleted by a newer version"
        if not (self.holds.versions and self.holds.deletes):
            self._newer_by_value(exp, out, rollbacks)
        res = self.res
        res.checked += len(exp.keys)
        counts = np.bincount(out.classes, minlength=len(CLASS_ORDER))
        for i, c in enumerate(CLASS_ORDER):
            res.counts[c] += int(counts[i])
        compared = out.diffs[~np.isnan(out.diffs)]
        if len(compared):
            res.max_abs_diff = max(res.max_abs_diff, float(compared.max()))
        if (np.isnan(out.diffs) & ~np.isnan(out.tolerance)).any():
            res.max_abs_diff = float("nan")
        if self.holds.versions:
            for v, live in version_counts(got.versions[got.found]):
                res.live_by_version[v] = res.live_by_version.get(v, 0) + live
        self._keep_worst(exp, got, out)

    def _newer_of_the_lineage(self, exp: ExpectedBatch, got: StoreBatch, out: BatchOutcome) -> None:
        """A newer row is SUPERSEDED only if a newer dump of this run wrote it at that version.

        Any other newer version (another run's row, a write outside the lineage) fails: as
        DIFFERENT where the key must hold a row, UNEXPECTED where it must be absent.
        """
        newer = np.nonzero(out.classes == CODE[RowClass.SUPERSEDED])[0]
        if not len(newer):
            return
        ours = self.later.wrote_at(self.res.table, exp.keys[newer], got.versions[newer])
        for i in newer[~ours].tolist():
            version = int(got.versions[i])
            g, s = split_version(version)
            out.classes[i] = CODE[RowClass.DIFFERENT if exp.present[i] else RowClass.UNEXPECTED]
            out.reasons[i] = (
                f"the store holds version {version} (generation {g}, dump {s}), which no dump "
                f"of run {self.later.run!r} wrote for this key: another run's row, or a write "
                "outside this run's lineage"
            )

    def _newer_by_value(
        self, exp: ExpectedBatch, out: BatchOutcome, rollbacks: frozenset[int]
    ) -> None:
        """On a store without versions or deletes, a row a newer dump wrote is SUPERSEDED.

        There a newer dump's row (or the fallback row of its delete) cannot be told from a
        wrong row by version; the artifacts say which keys newer dumps wrote. Rows of a
        rollback to this very point are not excused: they must equal the point's values.
        """
        bad = np.nonzero(
            np.isin(out.classes, [CODE[RowClass.DIFFERENT], CODE[RowClass.UNEXPECTED]])
        )[0]
        if len(bad):
            for i in bad[self.later.written(self.res.table, exp.keys[bad], rollbacks)]:
                out.classes[i] = CODE[RowClass.SUPERSEDED]
                out.reasons[i] = "a newer dump wrote it (the store keeps no versions)"

    def _keep_worst(self, exp: ExpectedBatch, got: StoreBatch, out: BatchOutcome) -> None:
        bad = np.nonzero(out.classes != CODE[RowClass.MATCH])[0]
        if len(bad) == 0 or self.limit == 0:
            return
        failing = np.isin(
            out.classes[bad],
            [CODE[RowClass.DIFFERENT], CODE[RowClass.MISSING], CODE[RowClass.UNEXPECTED]],
        )
        diff = np.where(np.isnan(out.diffs[bad]), np.inf, out.diffs[bad])
        top = bad[np.lexsort((-diff, ~failing))[: self.limit]]
        for i in top.tolist():
            ev = int(exp.versions[i])
            self.res.mismatches.append(
                Mismatch(
                    table=self.res.table,
                    key=int(exp.keys[i]),
                    row_class=CLASS_ORDER[int(out.classes[i])],
                    reason=out.reasons[i],
                    expected_version=None if ev == NO_RECORD else ev,
                    expected_present=bool(exp.present[i]),
                    store_version=int(got.versions[i])
                    if got.found[i] and self.holds.versions
                    else None,
                    max_abs_diff=None if np.isnan(out.diffs[i]) else float(out.diffs[i]),
                    tolerance=None if np.isnan(out.tolerance[i]) else float(out.tolerance[i]),
                )
            )
        self.res.mismatches.sort(key=Mismatch.severity, reverse=True)
        del self.res.mismatches[self.limit :]


def version_counts(versions: np.ndarray) -> list[tuple[int, int]]:
    """``(version, rows)`` pairs; a batch of one version (the usual case) needs no sort."""
    if len(versions) and (versions == versions[0]).all():
        return [(int(versions[0]), len(versions))]
    vers, n = np.unique(versions, return_counts=True)
    return list(zip(vers.tolist(), n.tolist(), strict=True))


__all__ = ["Collector", "version_counts"]
