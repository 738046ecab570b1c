"""Classification units (dtype-aware tolerance), the JSON schema, KFP metrics, HTML and CLI."""

import json
import re

import numpy as np
import pytest

from deltarec.artifacts import DType, DumpKind, codec
from deltarec.cli import main
from deltarec.ids import make_version
from deltarec.verify import RowClass, VerifyOptions, kfp_metrics, render_html, to_json, verify
from deltarec.verify.compare import CODE, ExpectedBatch, StoreBatch, classify

V = make_version(2, 3)


def _one(dtype, expected_values, stored_values):
    exp = codec.encode(np.asarray([expected_values], np.float32), dtype)
    got = codec.encode(np.asarray([stored_values], np.float32), dtype)
    return classify(
        ExpectedBatch(np.array([1]), np.array([V]), np.array([True]), exp),
        StoreBatch(np.array([True]), np.array([V]), got),
        dtype,
        len(expected_values),
        V,
    )


def test_float32_rows_must_match_bit_for_bit():
    assert _one(DType.FLOAT32, [1.0, 2.0], [1.0, 2.0]).classes[0] == CODE[RowClass.MATCH]
    nudged = np.nextafter(np.float32(2.0), np.float32(3.0))
    out = _one(DType.FLOAT32, [1.0, 2.0], [1.0, nudged])
    assert out.classes[0] == CODE[RowClass.DIFFERENT] and out.tolerance[0] == 0.0


def test_float16_and_int8_rows_match_within_their_precision_only():
    f16 = codec.encode(np.array([[1.0, -3.0]], np.float32), DType.FLOAT16)
    close = f16.astype(np.float32)  # a store holding float32 of the same values
    close[0, 0] += 4e-4  # below half an fp16 ulp at 1.0 scaled by amax 3 (2**-10 * 3)
    batch = ExpectedBatch(np.array([1]), np.array([V]), np.array([True]), f16)
    ok = classify(batch, StoreBatch(np.array([True]), np.array([V]), close), DType.FLOAT16, 2, V)
    assert ok.classes[0] == CODE[RowClass.MATCH] and 0 < ok.diffs[0] <= ok.tolerance[0]
    far = f16.astype(np.float32)
    far[0, 0] += 0.05
    bad = classify(batch, StoreBatch(np.array([True]), np.array([V]), far), DType.FLOAT16, 2, V)
    assert bad.classes[0] == CODE[RowClass.DIFFERENT]
    # int8_rowwise: re-quantizing the decoded row stays within one step; a shifted code does not.
    values = np.linspace(-1, 1, 16, dtype=np.float32)
    again = codec.decode(codec.encode(values[None], DType.INT8_ROWWISE), DType.INT8_ROWWISE, 16)
    assert _one(DType.INT8_ROWWISE, values, again[0]).classes[0] == CODE[RowClass.MATCH]
    exp = codec.encode(values[None], DType.INT8_ROWWISE)
    shifted = exp.copy()
    shifted[0, 3] += 9
    out = classify(
        ExpectedBatch(np.array([1]), np.array([V]), np.array([True]), exp),
        StoreBatch(np.array([True]), np.array([V]), shifted),
        DType.INT8_ROWWISE,
        16,
        V,
    )
    assert out.classes[0] == CODE[RowClass.DIFFERENT]


def test_nan_in_the_store_is_always_different():
    out = _one(DType.FLOAT16, [1.0, 2.0], [1.0, float("nan")])
    assert out.classes[0] == CODE[RowClass.DIFFERENT] and np.isnan(out.diffs[0])


def test_every_class_from_versions_alone():
    keys = np.arange(7)
    ev = np.array([V, V, V, V, V, -1, -1])
    present = np.array([True, True, True, True, False, False, False])
    sv = np.array([V, 0, V + 1, V - 1, V, V - 5, V + 9])
    found = np.array([True, False, True, True, True, True, True])
    rows = np.zeros((7, 2), np.float32)
    out = classify(
        ExpectedBatch(keys, ev, present, rows), StoreBatch(found, sv, rows), DType.FLOAT32, 2, V
    )
    names = [list(CODE)[c].value for c in out.classes]
    assert names == [
        "MATCH",
        "MISSING",
        "SUPERSEDED",
        "DIFFERENT",  # stale
        "UNEXPECTED",  # evicted key still served at its eviction version
        "UNEXPECTED",  # never written, older than the point
        "SUPERSEDED",  # never written by this lineage, newer than the point
    ]
    assert out.reasons[3] == "stale version"


def _published(lineage, store):
    g = lineage.generation()
    lineage.dump(g, 0, {lineage.T_EMB: (np.arange(50), 0.0)}, kind=DumpKind.SNAPSHOT)
    lineage.dump(g, 1, {lineage.T_EMB: (np.arange(5), 1.0)})
    lineage.publish(store, g)
    return g


JSON_KEYS = [
    "schema", "schema_version", "passed", "failure", "run", "generation", "through_seq",
    "version", "store", "mode", "sample", "seed", "started_at", "duration_s", "totals",
    "failing_classes", "shards", "errors", "rollback_generations", "staged_tables", "tables",
    "dumps", "notes", "store_id",
]  # fmt: skip
TABLE_KEYS = [
    "table", "dtype", "dim", "expected_keys", "expected_present", "checked",
    "store_keys_scanned", "failures", "max_abs_diff", "counts", "mismatches", "store_keys",
    "key_count_problem",
]  # fmt: skip
MISMATCH_KEYS = [
    "key", "class", "reason", "expected_version", "expected_present", "store_version",
    "max_abs_diff", "tolerance",
]  # fmt: skip
DUMP_KEYS = [
    "generation", "seq", "version", "kind", "created_at", "first_step", "last_step", "rows",
    "age_s", "live_rows", "lag_s",
]  # fmt: skip


def test_json_schema_is_frozen(lineage, sqlite_store):
    g = _published(lineage, sqlite_store)
    sqlite_store.delete(lineage.T_EMB, np.array([7]), make_version(g, 0))
    doc = to_json(
        verify(lineage.root, lineage.run, sqlite_store, options=VerifyOptions(sample=None))
    )
    assert list(doc) == JSON_KEYS
    assert doc["schema"] == "deltarec.verify" and doc["schema_version"] == 1
    assert list(doc["totals"]) == ["checked", *[c.value for c in RowClass]]
    assert [t["table"] for t in doc["tables"]] == sorted([lineage.T_EMB, lineage.T_ZCH])
    table = doc["tables"][0]
    assert list(table) == TABLE_KEYS and list(table["mismatches"][0]) == MISMATCH_KEYS
    assert list(doc["dumps"][0]) == DUMP_KEYS
    assert doc["passed"] is False and doc["totals"]["MISSING"] == 1
    assert table["mismatches"][0]["key"] == 7
    json.dumps(doc, allow_nan=False)


def test_kfp_metrics_are_plain_numbers(lineage, sqlite_store):
    _published(lineage, sqlite_store)
    metrics = kfp_metrics(
        verify(lineage.root, lineage.run, sqlite_store, options=VerifyOptions(sample=None))
    )
    assert all(isinstance(v, float) for v in metrics.values())
    assert metrics["passed"] == 1.0 and metrics["keys_checked"] == 50.0
    assert metrics["keys_match"] == 50.0 and metrics["match_rate"] == 1.0
    assert metrics["shards_checked"] == 2.0 and metrics["shard_failures"] == 0.0


def test_html_report_is_self_contained_with_counts_mismatches_and_plot(lineage, sqlite_store):
    g = _published(lineage, sqlite_store)
    sqlite_store.delete(lineage.T_EMB, np.array([7]), make_version(g, 0))
    page = render_html(
        verify(lineage.root, lineage.run, sqlite_store, options=VerifyOptions(sample=None))
    )
    assert page.startswith("<!DOCTYPE html>") and "FAILED" in page
    assert not re.search(r"<script|<link|src=|@import|url\(", page)
    assert "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "<svg" in page and page.count("<circle") == 2  # one point per dump
    assert "sparse.ebc.user_id" in page and "<td>7</td>" in page


def test_cli_verify_exit_codes_and_outputs(lineage, sqlite_store, sqlite_url, tmp_path, capsys):
    g = _published(lineage, sqlite_store)
    base = ["verify", "--artifacts", lineage.root.uri, "--run", lineage.run, "--store", sqlite_url]
    out_json, report, metrics = tmp_path / "v.json", tmp_path / "v.html", tmp_path / "m.json"
    extra = ["--all", "--json", str(out_json), "--report", str(report), "--metrics", str(metrics)]
    assert main([*base, *extra]) == 0
    assert json.loads(out_json.read_text())["passed"] is True
    assert "<svg" in report.read_text() and json.loads(metrics.read_text())["passed"] == 1.0
    record = lineage.root.gen_dir(lineage.run, g) + "/verifications"
    assert len(lineage.root.fs.ls(record)) == 1

    bad = lineage.expected_row(lineage.T_EMB, np.array([3]), 5.0)
    sqlite_store.write(
        lineage.T_EMB, np.array([3]), bad, np.zeros(1, np.int8), [make_version(g, 1)]
    )
    capsys.readouterr()
    assert main([*base, "--sample", "50"]) == 1
    err = capsys.readouterr().err
    assert "DIFFERENT 1" in err and "key 3" in err

    assert main([*base, "--generation", "4"]) == 2
    assert "no generation 4" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main([*base, "--all", "--sample", "3"])
    assert e.value.code == 2


def test_cli_promote_refuses_then_promotes_and_rollback_restores(
    lineage, sqlite_store, sqlite_url, capsys
):
    g = _published(lineage, sqlite_store)
    common = ["--artifacts", lineage.root.uri, "--run", lineage.run, "--store", sqlite_url]
    assert main(["promote", *common, "--generation", str(g)]) == 1
    assert "never verified" in capsys.readouterr().err
    assert main(["verify", *common]) == 0
    assert main(["promote", *common, "--generation", str(g)]) == 0
    assert "generation 1 through dump 1" in capsys.readouterr().out
    g2 = lineage.generation()
    lineage.dump(g2, 1, {lineage.T_EMB: (np.array([1, 99]), 3.0)})
    lineage.publish(sqlite_store, g2)
    assert main(["rollback", *common, "--to-generation", str(g)]) == 0
    out = capsys.readouterr().out  # every key of the point republished; key 99 removed
    assert "50 keys republished, 0 of them came back, 1 removed" in out
    assert main(["verify", *common, "--generation", str(g), "--all"]) == 0


def test_cli_rollback_exits_1_naming_what_differs_when_the_store_does_not_equal_the_point(
    lineage, sqlite_store, sqlite_url, capsys, monkeypatch
):
    from deltarec.stores.sql.sqlite import SqliteStore

    g = _published(lineage, sqlite_store)
    common = ["--artifacts", lineage.root.uri, "--run", lineage.run, "--store", sqlite_url]
    assert main(["verify", *common]) == 0 and main(["promote", *common, "--generation", "1"]) == 0
    g2 = lineage.generation()
    lineage.dump(g2, 1, {lineage.T_EMB: (np.array([1, 99]), 3.0)})
    lineage.publish(sqlite_store, g2)
    monkeypatch.setattr(SqliteStore, "sweep_below", lambda self, table, version: None)
    capsys.readouterr()
    assert main(["rollback", *common, "--to-generation", str(g)]) == 1  # key 99 was not removed
    printed = capsys.readouterr()
    assert "against generation 1 dump 1: DIFFERENT" in printed.out
    assert "check failed" in printed.err and "SUPERSEDED) (e.g. key 99)" in printed.err


def _options(command):
    from deltarec.cli import build_parser

    parser = build_parser(command)
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return sorted(o for a in sub._actions for o in a.option_strings if o not in ("-h", "--help"))


def test_cli_options_are_frozen():
    assert _options("verify") == sorted(
        ["--artifacts", "--run", "--store", "--generation", "--through-seq", "--sample", "--all",
         "--seed", "--json", "--report", "--metrics", "--batch-size", "--max-mismatches",
         "--no-record", "--partition", "--combine"]
    )  # fmt: skip
    assert _options("promote") == sorted(
        ["--artifacts", "--run", "--store", "--generation", "--through-seq", "--force"]
    )
    assert _options("rollback") == sorted(
        ["--artifacts", "--run", "--store", "--to-generation", "--through-seq", "--sample"]
    )


class _FailingScan:
    """A real store whose row scan breaks after its first batch (a store that goes away)."""

    def __init__(self, store):
        self._store = store

    def __getattr__(self, name):
        return getattr(self._store, name)

    def scan_rows(self, table, batch_rows=65536):
        from deltarec.errors import StoreUnavailableError

        for i, item in enumerate(self._store.scan_rows(table, 10)):
            if i == 1:
                raise StoreUnavailableError("connection reset while scanning")
            yield item


def test_a_store_failing_during_the_scan_fails_the_verification_loudly(lineage, sqlite_store):
    from deltarec.errors import StoreUnavailableError

    _published(lineage, sqlite_store)
    with pytest.raises(StoreUnavailableError, match="connection reset"):
        verify(
            lineage.root,
            lineage.run,
            _FailingScan(sqlite_store),
            options=VerifyOptions(sample=None),
        )
