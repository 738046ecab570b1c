"""Dataclasses and enums of a verification (SPEC §7): classes, mismatches, per-table results.

These records are what :func:`deltarec.verify.verify` returns and what the JSON, HTML and
rich outputs render. They hold numbers and small lists only (the worst mismatches per table,
never every key), so a result of a billion-row verification still fits in memory and in JSON.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RowClass(str, enum.Enum):
    """How one key of the store compares with the expected state.

    * ``MATCH``: the store holds the expected row (same version, values within tolerance), or
      the key is expected absent and the store does not hold it, or the store holds a row that
      a rollback to this very point republished with the expected values.
    * ``DIFFERENT``: the store holds the expected version with other values, or an older
      (stale) version, or a rollback row with other values than the expected ones.
    * ``MISSING``: the key is expected present and the store does not hold it.
    * ``UNEXPECTED``: the key is expected absent (evicted, removed by a snapshot, or never
      written by the lineage) and the store holds it at a version not newer than the point
      verified.
    * ``SUPERSEDED``: the store holds a newer version than the one expected (a later dump or
      generation has been published since); not compared by value.
    """

    MATCH = "MATCH"
    DIFFERENT = "DIFFERENT"
    MISSING = "MISSING"
    UNEXPECTED = "UNEXPECTED"
    SUPERSEDED = "SUPERSEDED"


CLASS_ORDER: tuple[RowClass, ...] = tuple(RowClass)
"""The classes in their reporting order (also their integer code in arrays)."""

FAILING_CLASSES: frozenset[RowClass] = frozenset(
    {RowClass.DIFFERENT, RowClass.MISSING, RowClass.UNEXPECTED}
)
"""Classes that make a verification fail. SUPERSEDED does not: serving moved on, legitimately."""


@dataclass(frozen=True)
class Mismatch:
    """One key that did not MATCH (only the worst few per table are kept).

    Attributes:
        table: table id.
        key: the key serving looks up.
        row_class: DIFFERENT, MISSING, UNEXPECTED or SUPERSEDED.
        reason: a short human explanation (e.g. ``"values differ"``, ``"stale version"``).
        expected_version: the version of the expected record, None if the lineage never wrote
            the key.
        expected_present: whether serving must hold the key.
        store_version: the version the store holds, None if it does not hold the key.
        max_abs_diff: largest absolute difference of the decoded values (DIFFERENT by value).
        tolerance: the dtype-aware tolerance the difference was compared with.
    """

    table: str
    key: int
    row_class: RowClass
    reason: str
    expected_version: int | None
    expected_present: bool
    store_version: int | None
    max_abs_diff: float | None = None
    tolerance: float | None = None

    def severity(self) -> tuple[int, float]:
        """Sort key, larger is worse: failing classes first, then by difference."""
        failing = 1 if self.row_class in FAILING_CLASSES else 0
        diff = self.max_abs_diff if self.max_abs_diff is not None else float("inf")
        return failing, diff


@dataclass
class TableResult:
    """The outcome for one table.

    Attributes:
        table: table id.
        dtype, dim: the table's encoding.
        expected_keys: keys with a record in the lineage (present or absent).
        expected_present: keys that serving must hold.
        checked: keys compared (the sample, or every expected key with ``--all``).
        store_keys_scanned: keys read from the store's key scan (``--all`` only, else None).
        counts: class -> number of keys.
        max_abs_diff: the largest value difference among keys compared by value.
        mismatches: the worst non-MATCH keys, worst first (at most the configured limit).
        live_by_version: version -> number of checked keys the store holds at that version
            (the freshness plot's data).
        store_keys: the keys the store's live view holds, counted by a sampled verify
            (:mod:`deltarec.verify.count`); None where it was not counted.
        key_count_problem: why that count fails the check (it is not the expected state's
            present keys), or empty.
    """

    table: str
    dtype: str
    dim: int
    expected_keys: int = 0
    expected_present: int = 0
    checked: int = 0
    store_keys_scanned: int | None = None
    counts: dict[RowClass, int] = field(default_factory=lambda: dict.fromkeys(RowClass, 0))
    max_abs_diff: float = 0.0
    mismatches: list[Mismatch] = field(default_factory=list)
    live_by_version: dict[int, int] = field(default_factory=dict)
    store_keys: int | None = None
    key_count_problem: str = ""

    @property
    def failures(self) -> int:
        """Keys in a failing class."""
        return sum(self.counts[c] for c in FAILING_CLASSES)


@dataclass(frozen=True)
class ShardFailure:
    """A shard whose sha256, size or row count does not match its manifest, or is unreadable."""

    path: str
    table: str
    rank: int
    generation: int
    seq: int
    problem: str


@dataclass(frozen=True)
class DumpFreshness:
    """One committed dump of the lineage, with how fresh serving is with respect to it.

    Attributes:
        generation, seq, version, kind: the dump.
        created_at: the manifest's commit time (ISO 8601, UTC).
        first_step, last_step: the training steps it covers.
        rows: rows across all tables and ranks.
        age_s: seconds between the dump's commit and the verification.
        live_rows: checked keys that the store holds at this dump's version.
        lag_s: freshness, seconds from the dump's training step (when it was taken; its
            commit for dumps without ``taken_at``) until its rows were visible in the store
            (the slowest rank), from the store's freshness records; None if the store has no
            record of it.
    """

    generation: int
    seq: int
    version: int
    kind: str
    created_at: str
    first_step: int
    last_step: int
    rows: int
    age_s: float | None
    live_rows: int
    lag_s: float | None = None


@dataclass
class VerifyResult:
    """Everything a verification found.

    Attributes:
        run, generation, through_seq: what was verified (``through_seq`` resolved: the newest
            committed dump when none was asked for; None if the generation has no dump).
        version: the version of the newest dump included (0 if none).
        store: the store URL with any password removed.
        mode: ``"sample"`` or ``"all"``.
        sample: keys sampled per table (None with ``--all``).
        seed: the sampling seed.
        started_at: ISO 8601 UTC start time; duration_s: wall time.
        shards_checked: shards whose sha256 and row count were checked.
        shard_failures: shards that failed the check.
        errors: problems that prevented a comparison (e.g. an unreadable shard).
        tables: per-table results, by table id.
        dumps: the lineage's dumps, oldest first, with freshness.
        rollback_generations: generations recorded as rollbacks to this point, whose rows are
            compared by value.
        staged_tables: tables read through the generation's staging view (merged over the
            live view) because it was published in staged mode and is not promoted yet.
        notes: what the store cannot show, and how its rows were classified for it (a store
            without versions, deletes or key listing); not failures.
        store_id: the verified store's id (:func:`deltarec.verify.records.store_id`, of its
            identity, not of its URL): the verification record is bound to it.
    """

    run: str
    generation: int
    through_seq: int | None
    version: int
    store: str
    mode: str
    sample: int | None
    seed: int
    started_at: str
    duration_s: float = 0.0
    shards_checked: int = 0
    shard_failures: list[ShardFailure] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    tables: dict[str, TableResult] = field(default_factory=dict)
    dumps: list[DumpFreshness] = field(default_factory=list)
    rollback_generations: list[int] = field(default_factory=list)
    staged_tables: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    store_id: str = ""

    def totals(self) -> dict[RowClass, int]:
        """Class -> keys, over every table."""
        out = dict.fromkeys(RowClass, 0)
        for t in self.tables.values():
            for c, n in t.counts.items():
                out[c] += n
        return out

    @property
    def checked(self) -> int:
        """Keys compared over every table."""
        return sum(t.checked for t in self.tables.values())

    @property
    def passed(self) -> bool:
        """True if nothing failed and at least one key matched.

        Nothing failed: no shard, no error, no key in a failing class. A store that showed no
        key equal to the artifacts proves nothing, so it does not pass either.
        """
        if self.shard_failures or self.errors or not self.totals()[RowClass.MATCH]:
            return False
        return all(t.failures == 0 and not t.key_count_problem for t in self.tables.values())

    def failure_summary(self) -> str:
        """One line naming what failed (empty if the verification passed)."""
        parts: list[str] = []
        if self.shard_failures:
            first = self.shard_failures[0]
            parts.append(
                f"{len(self.shard_failures)} shard(s) fail their checksum (first: {first.path}: "
                f"{first.problem})"
            )
        parts.extend(self.errors)
        if not self.totals()[RowClass.MATCH]:
            parts.append(
                f"no key matched: of {self.checked} keys checked, none holds run "
                f"{self.run!r}'s row in the store, so nothing was shown to be served"
            )
        for t in self.tables.values():
            if t.failures or t.key_count_problem:
                problems = _class_examples(t) + ([t.key_count_problem] * bool(t.key_count_problem))
                parts.append(f"table {t.table!r}: " + ", ".join(problems))
        return "; ".join(parts)


def _class_examples(t: TableResult) -> list[str]:
    """``DIFFERENT 2 (e.g. key 3: values differ)`` for each failing class with keys."""
    out = []
    for c in CLASS_ORDER:
        if c not in FAILING_CLASSES or not t.counts[c]:
            continue
        example = next((m for m in t.mismatches if m.row_class is c), None)
        text = f"{c.value} {t.counts[c]}"
        if example is not None:
            text += f" (e.g. key {example.key}: {example.reason})"
        out.append(text)
    return out
