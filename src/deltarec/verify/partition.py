"""Verify in parts: partition I of N checks one key range of every table, and a gate combines.

A verification can be split into ``N`` partitions that run anywhere (pipeline tasks, pods,
shells) and are combined into one result (:func:`combine`) equal to a single verification of
the same store, key for key: the same classes for the same keys.

**The partition rule.** For each table, the expected keys (sorted, unique; the same in every
partition, since they come from the artifacts) are cut into ``N`` ranges of equal size:
boundaries ``b_i = keys[i * n // N]`` for ``0 < i < N``, ``b_0 = -inf``, ``b_N = +inf``.
Partition ``I`` owns every key ``k`` with ``b_I <= k < b_{I+1}``: its share of the expected
keys, and every store key in that range (so a key the lineage never wrote belongs to exactly
one partition too). Shard checksums are shared out by position (shard ``j`` of the lineage's
sorted list belongs to partition ``j mod N``). So the partitions cover every table x key range
once, and nothing twice.

A partition leaves no verification record (promote needs the whole); the gate that combines
them writes it (:func:`deltarec.verify.run.combine_partitions`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from deltarec.errors import BadInputError
from deltarec.verify.types import (
    DumpFreshness,
    Mismatch,
    RowClass,
    ShardFailure,
    TableResult,
    VerifyResult,
)

T = TypeVar("T")

_SPEC = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")
PARTITION_NOTE = "partition {index}/{count}: one key range of every table (of {count})"


@dataclass(frozen=True)
class Partition:
    """Partition ``index`` of ``count`` (0-based): see the module docstring for the rule.

    Raises:
        BadInputError: ``count < 1`` or ``index`` outside ``[0, count)``.
    """

    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise BadInputError(
                f"verify partition {self.index}/{self.count}: need 0 <= I < N (e.g. 0/4 .. 3/4)"
            )

    @classmethod
    def parse(cls, text: str) -> Partition:
        """``"I/N"`` (e.g. ``"2/8"``) as a partition.

        Raises:
            BadInputError: not of the form ``I/N`` with ``0 <= I < N``.
        """
        m = _SPEC.match(text)
        if not m:
            raise BadInputError(f"verify partition {text!r} is not I/N (e.g. 0/4)")
        return cls(int(m.group(1)), int(m.group(2)))

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def bounds(self, expected_keys: np.ndarray) -> tuple[int | None, int | None]:
        """``(low, high)``: keys ``low <= k < high`` belong to this partition (None: unbounded).

        ``expected_keys`` are the table's sorted, unique expected keys.
        """
        n = len(expected_keys)

        def cut(i: int) -> int | None:
            if i <= 0 or i >= self.count or n == 0:
                return None
            return int(expected_keys[min(i * n // self.count, n - 1)])

        low, high = cut(self.index), cut(self.index + 1)
        if self.index > 0 and low is None:  # no key: every range but the first is empty
            return 0, 0
        return low, high

    def mask(self, expected_keys: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Which of ``keys`` belong to this partition (boolean, same shape as ``keys``)."""
        low, high = self.bounds(expected_keys)
        keys = np.asarray(keys, np.int64)
        out = np.ones(keys.shape, bool)
        if low is not None:
            out &= keys >= low
        if high is not None:
            out &= keys < high
        return out

    def share(self, items: Sequence[T]) -> list[T]:
        """This partition's share of ``items`` (item ``j`` belongs to partition ``j mod N``)."""
        return list(items[self.index :: self.count])


def combine(results: Sequence[VerifyResult], max_mismatches: int = 20) -> VerifyResult:
    """One result from the results of partitions ``0/N .. N-1/N`` of one verification.

    Counts, checked keys, scanned store keys, shards checked and live rows per version add up;
    the worst ``max_mismatches`` mismatches per table are kept; errors, shard failures and
    notes are gathered (the partitions' own notes dropped); the duration is the slowest
    partition's.

    Raises:
        BadInputError: no results, results of different verifications (run, generation, dump,
            store, mode, sample, seed), or not exactly the partitions ``0 .. N-1`` of one N
            (read from each result's partition note).
    """
    if not results:
        raise BadInputError("no verify partition results to combine")
    first = results[0]
    what = (
        "run",
        "generation",
        "through_seq",
        "version",
        "store",
        "store_id",
        "mode",
        "sample",
        "seed",
    )
    for r in results[1:]:
        diff = [a for a in what if getattr(r, a) != getattr(first, a)]
        if diff:
            raise BadInputError(
                f"verify partitions of different verifications differ in {diff}: "
                f"{[getattr(first, a) for a in diff]} vs {[getattr(r, a) for a in diff]}"
            )
    _check_cover([_partition_of(r) for r in results])
    out = VerifyResult(
        run=first.run,
        generation=first.generation,
        through_seq=first.through_seq,
        version=first.version,
        store=first.store,
        store_id=first.store_id,
        mode=first.mode,
        sample=first.sample,
        seed=first.seed,
        started_at=min(r.started_at for r in results),
        duration_s=max(r.duration_s for r in results),
        shards_checked=sum(r.shards_checked for r in results),
        rollback_generations=list(first.rollback_generations),
        staged_tables=sorted({t for r in results for t in r.staged_tables}),
    )
    for r in results:
        out.shard_failures.extend(r.shard_failures)
        out.errors.extend(e for e in r.errors if e not in out.errors)
        out.notes.extend(n for n in r.notes if n not in out.notes and not _is_part_note(n))
        for t in r.tables.values():
            _add_table(out.tables, t)
    for t in out.tables.values():
        t.mismatches.sort(key=Mismatch.severity, reverse=True)
        del t.mismatches[max_mismatches:]
    out.tables = dict(sorted(out.tables.items()))
    out.dumps = _combine_dumps([r.dumps for r in results])
    return out


def _add_table(tables: dict[str, TableResult], t: TableResult) -> None:
    acc = tables.get(t.table)
    if acc is None:
        acc = tables[t.table] = TableResult(t.table, t.dtype, t.dim)
        acc.expected_keys, acc.expected_present = t.expected_keys, t.expected_present
    acc.checked += t.checked
    if t.store_keys_scanned is not None:
        acc.store_keys_scanned = (acc.store_keys_scanned or 0) + t.store_keys_scanned
    if t.store_keys is not None:  # counted whole, by a verification of one partition only
        acc.store_keys, acc.key_count_problem = t.store_keys, t.key_count_problem
    for c, n in t.counts.items():
        acc.counts[c] = acc.counts.get(c, 0) + n
    acc.max_abs_diff = max(acc.max_abs_diff, t.max_abs_diff)
    acc.mismatches.extend(t.mismatches)
    for v, n in t.live_by_version.items():
        acc.live_by_version[v] = acc.live_by_version.get(v, 0) + n


def _combine_dumps(parts: Sequence[list[DumpFreshness]]) -> list[DumpFreshness]:
    out: dict[tuple[int, int], DumpFreshness] = {}
    for dumps in parts:
        for d in dumps:
            have = out.get((d.generation, d.seq))
            if have is None:
                out[(d.generation, d.seq)] = d
            else:
                out[(d.generation, d.seq)] = DumpFreshness(
                    **{**have.__dict__, "live_rows": have.live_rows + d.live_rows}
                )
    return [out[k] for k in sorted(out)]


_NOTE = re.compile(r"^partition (\d+)/(\d+): ")


def _is_part_note(note: str) -> bool:
    return bool(_NOTE.match(note))


def _partition_of(result: VerifyResult) -> Partition:
    for note in result.notes:
        m = _NOTE.match(note)
        if m:
            return Partition(int(m.group(1)), int(m.group(2)))
    raise BadInputError(
        f"a verify result of run {result.run!r} generation {result.generation} is not a "
        "partition (it has no partition note): combine only results of verify --partition"
    )


def _check_cover(parts: Sequence[Partition]) -> None:
    counts = {p.count for p in parts}
    if len(counts) != 1:
        raise BadInputError(f"verify partitions of different counts: {sorted(counts)}")
    (n,) = counts
    got = sorted(p.index for p in parts)
    if got != list(range(n)):
        missing = sorted(set(range(n)) - set(got))
        twice = sorted({i for i in got if got.count(i) > 1})
        raise BadInputError(
            f"verify partitions do not cover 0..{n - 1} once: missing {missing}, twice {twice}"
        )


def partition_json(result: VerifyResult) -> dict[str, Any]:
    """The JSON document of a partition's result, to hand to the gate.

    :func:`deltarec.verify.to_json` plus each table's ``live_by_version`` (the freshness data
    the gate's report plots).
    """
    from deltarec.verify.output import to_json

    doc = to_json(result)
    for t in doc["tables"]:
        live = result.tables[t["table"]].live_by_version
        t["live_by_version"] = {str(v): n for v, n in sorted(live.items())}
    return doc


def result_from_json(doc: dict[str, Any]) -> VerifyResult:
    """A :class:`VerifyResult` from its JSON document (:func:`partition_json`).

    So a partition's result can travel between pipeline tasks.

    Raises:
        BadInputError: not a verify document.
    """
    try:
        result = VerifyResult(
            run=str(doc["run"]),
            generation=int(doc["generation"]),
            through_seq=doc["through_seq"],
            version=int(doc["version"]),
            store=str(doc["store"]),
            store_id=str(doc.get("store_id", "")),
            mode=str(doc["mode"]),
            sample=doc["sample"],
            seed=int(doc["seed"]),
            started_at=str(doc["started_at"]),
            duration_s=float(doc["duration_s"]),
            shards_checked=int(doc["shards"]["checked"]),
            shard_failures=[ShardFailure(**f) for f in doc["shards"]["failed"]],
            errors=list(doc["errors"]),
            rollback_generations=list(doc["rollback_generations"]),
            staged_tables=list(doc["staged_tables"]),
            notes=list(doc["notes"]),
        )
        for t in doc["tables"]:
            res = TableResult(str(t["table"]), str(t["dtype"]), int(t["dim"]))
            res.expected_keys, res.expected_present = t["expected_keys"], t["expected_present"]
            res.checked, res.store_keys_scanned = t["checked"], t["store_keys_scanned"]
            res.store_keys = t.get("store_keys")
            res.key_count_problem = str(t.get("key_count_problem", ""))
            res.max_abs_diff = float("nan") if t["max_abs_diff"] is None else t["max_abs_diff"]
            res.counts = {RowClass(c): int(n) for c, n in t["counts"].items()}
            res.mismatches = [
                Mismatch(
                    table=res.table,
                    key=int(m["key"]),
                    row_class=RowClass(m["class"]),
                    reason=str(m["reason"]),
                    expected_version=m["expected_version"],
                    expected_present=bool(m["expected_present"]),
                    store_version=m["store_version"],
                    max_abs_diff=m["max_abs_diff"],
                    tolerance=m["tolerance"],
                )
                for m in t["mismatches"]
            ]
            res.live_by_version = {int(v): int(n) for v, n in t.get("live_by_version", {}).items()}
            result.tables[res.table] = res
        result.dumps = [DumpFreshness(**d) for d in doc["dumps"]]
    except (KeyError, TypeError, ValueError) as e:
        raise BadInputError(f"not a verify result document: {e!r}") from e
    return result


__all__ = ["PARTITION_NOTE", "Partition", "combine", "partition_json", "result_from_json"]
