"""Machine outputs of a verification: the stable JSON document and KFP metrics.

JSON schema (``schema_version`` 1; fields may be added, none removed or renamed)::

    {
      "schema": "deltarec.verify",   "schema_version": 1,
      "passed": true,                 # the verdict (exit code 0 iff true)
      "failure": "",                  # one line naming what failed ("" when passed)
      "run": "demo", "generation": 2, "through_seq": 5, "version": 8589934597,
      "store": "sqlite:///store.db",  # credentials removed
      "mode": "sample" | "all", "sample": 10000 | null, "seed": 0,
      "started_at": "2026-12-02T10:05:00.000000Z", "duration_s": 1.25,
      "totals": {"checked": 20000, "MATCH": 19990, "DIFFERENT": 0, "MISSING": 0,
                 "UNEXPECTED": 0, "SUPERSEDED": 10},
      "failing_classes": ["DIFFERENT", "MISSING", "UNEXPECTED"],
      "shards": {"checked": 12, "failed": [{"path": "...", "table": "...", "rank": 0,
                 "generation": 2, "seq": 3, "problem": "sha256 ... does not match ..."}]},
      "errors": ["..."],
      "rollback_generations": [4],   # rollbacks to this point: compared by value
      "staged_tables": [],            # read as staging merged over live (not promoted yet)
      "tables": [{"table": "sparse.ebc.user_id", "dtype": "float32", "dim": 64,
                  "expected_keys": 1000, "expected_present": 990, "checked": 1000,
                  "store_keys_scanned": null, "failures": 0, "max_abs_diff": 0.0,
                  "counts": {"MATCH": 1000, "DIFFERENT": 0, ...},
                  "mismatches": [{"key": 17, "class": "DIFFERENT", "reason": "values differ",
                                  "expected_version": 8589934595, "expected_present": true,
                                  "store_version": 8589934595, "max_abs_diff": 0.5,
                                  "tolerance": 0.0}],
                  "store_keys": 990,         # counted by a sampled verify (else null)
                  "key_count_problem": ""}],  # why that count fails, or empty
      "dumps": [{"generation": 2, "seq": 1, "version": 8589934593, "kind": "delta",
                 "created_at": "...", "first_step": 1, "last_step": 50, "rows": 1234,
                 "age_s": 60.5, "live_rows": 321,
                 "lag_s": 0.8}],
      "notes": ["..."],               # what the store cannot show (no key listing, ...)
      "store_id": "3f9c0a7d12e4b605"  # the store's identity hashed: the record is bound to it
    }

Numbers that are not finite (NaN) are written as ``null``. Tables are sorted by table id,
mismatches worst first, dumps oldest first.
"""

from __future__ import annotations

import json
import math
from typing import Any

from deltarec.verify.types import CLASS_ORDER, FAILING_CLASSES, RowClass, VerifyResult

SCHEMA = "deltarec.verify"
SCHEMA_VERSION = 1


def _num(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else x


def _counts(counts: dict[RowClass, int]) -> dict[str, int]:
    return {c.value: int(counts.get(c, 0)) for c in CLASS_ORDER}


def to_json(result: VerifyResult) -> dict[str, Any]:
    """The JSON document of a result (see the module docstring for the schema)."""
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "passed": result.passed,
        "failure": result.failure_summary(),
        "run": result.run,
        "generation": result.generation,
        "through_seq": result.through_seq,
        "version": result.version,
        "store": result.store,
        "mode": result.mode,
        "sample": result.sample,
        "seed": result.seed,
        "started_at": result.started_at,
        "duration_s": round(result.duration_s, 6),
        "totals": {"checked": result.checked, **_counts(result.totals())},
        "failing_classes": [c.value for c in CLASS_ORDER if c in FAILING_CLASSES],
        "shards": {
            "checked": result.shards_checked,
            "failed": [
                {
                    "path": f.path,
                    "table": f.table,
                    "rank": f.rank,
                    "generation": f.generation,
                    "seq": f.seq,
                    "problem": f.problem,
                }
                for f in result.shard_failures
            ],
        },
        "errors": list(result.errors),
        "rollback_generations": list(result.rollback_generations),
        "staged_tables": list(result.staged_tables),
        "tables": [_table_json(t) for _, t in sorted(result.tables.items())],
        "dumps": [
            {
                "generation": d.generation,
                "seq": d.seq,
                "version": d.version,
                "kind": d.kind,
                "created_at": d.created_at,
                "first_step": d.first_step,
                "last_step": d.last_step,
                "rows": d.rows,
                "age_s": _num(d.age_s),
                "live_rows": d.live_rows,
                "lag_s": _num(d.lag_s),
            }
            for d in result.dumps
        ],
        "notes": list(result.notes),
        "store_id": result.store_id,
    }


def _table_json(t: Any) -> dict[str, Any]:
    return {
        "table": t.table,
        "dtype": t.dtype,
        "dim": t.dim,
        "expected_keys": t.expected_keys,
        "expected_present": t.expected_present,
        "checked": t.checked,
        "store_keys_scanned": t.store_keys_scanned,
        "failures": t.failures,
        "max_abs_diff": _num(t.max_abs_diff),
        "counts": _counts(t.counts),
        "mismatches": [
            {
                "key": m.key,
                "class": m.row_class.value,
                "reason": m.reason,
                "expected_version": m.expected_version,
                "expected_present": m.expected_present,
                "store_version": m.store_version,
                "max_abs_diff": _num(m.max_abs_diff),
                "tolerance": _num(m.tolerance),
            }
            for m in t.mismatches
        ],
        "store_keys": t.store_keys,
        "key_count_problem": t.key_count_problem,
    }


def dumps_json(result: VerifyResult) -> str:
    """The JSON document as text (indented, keys in schema order)."""
    return json.dumps(to_json(result), indent=2, allow_nan=False)


def kfp_metrics(result: VerifyResult) -> dict[str, float]:
    """Scalar metrics for a KFP ``Metrics`` artifact (``metrics.log_metric(name, value)``).

    Keys: ``passed`` (1/0), ``keys_checked``, one ``keys_<class>`` per class (lower case),
    ``match_rate`` (MATCH / checked, 1.0 when nothing was checked), ``shards_checked``,
    ``shard_failures``, ``errors``, ``max_abs_diff`` (over compared values, -1 when NaN),
    ``duration_s``, ``keys_per_s``, ``newest_dump_age_s`` (-1 when unknown), ``tables``.
    """
    totals = result.totals()
    checked = result.checked
    diffs = [t.max_abs_diff for t in result.tables.values()]
    max_diff = max(diffs, default=0.0)
    newest = result.dumps[-1].age_s if result.dumps else None
    out: dict[str, float] = {
        "passed": 1.0 if result.passed else 0.0,
        "keys_checked": float(checked),
        **{f"keys_{c.value.lower()}": float(totals[c]) for c in CLASS_ORDER},
        "match_rate": totals[RowClass.MATCH] / checked if checked else 1.0,
        "shards_checked": float(result.shards_checked),
        "shard_failures": float(len(result.shard_failures)),
        "errors": float(len(result.errors)),
        "max_abs_diff": max_diff if math.isfinite(max_diff) else -1.0,
        "duration_s": float(result.duration_s),
        "keys_per_s": checked / result.duration_s if result.duration_s > 0 else 0.0,
        "newest_dump_age_s": float(newest) if newest is not None else -1.0,
        "tables": float(len(result.tables)),
    }
    return out
