"""``--sample`` means the same everywhere, and a sample also counts each table's keys.

``--sample 0`` (and the pipeline's ``sample_size`` 0) checks every key, as ``--all``; a
negative sample is refused. A sampled verify compares each table's key count in the store
with the expected state's, so a row the lineage never wrote fails it even outside the sample.
"""

import json

import numpy as np
import pytest
from tests._helpers.artifacts import ZCH_KEYS

from deltarec.artifacts import Parent
from deltarec.cli import main
from deltarec.errors import BadInputError
from deltarec.ids import make_version
from deltarec.verify import VerifyOptions, verify
from deltarec.verify.count import NOT_COUNTED

from .conftest import base_generation


def _sampled(lineage, store, generation=None, sample=2):
    return verify(
        lineage.root,
        lineage.run,
        store,
        generation=generation,
        options=VerifyOptions(sample=sample, seed=3),
    )


def test_sample_zero_checks_every_key_and_a_negative_sample_is_refused():
    assert VerifyOptions(sample=0).all_keys and VerifyOptions(sample=0).sample is None
    with pytest.raises(BadInputError, match="0: every key"):
        VerifyOptions(sample=-1)


@pytest.mark.parametrize("command", ["verify", "rollback"])
def test_cli_sample_zero_is_every_key_and_negative_is_bad_usage(
    lineage, sqlite_store, sqlite_url, tmp_path, command, capsys
):
    base_generation(lineage, sqlite_store)
    common = ["--artifacts", lineage.root.uri, "--run", lineage.run, "--store", sqlite_url]
    with pytest.raises(SystemExit) as bad:
        main([command, *common, "--sample", "-3"])
    assert bad.value.code == 2 and "must be >= 0 keys per table" in capsys.readouterr().err
    if command == "verify":
        out = tmp_path / "v.json"
        assert main(["verify", *common, "--sample", "0", "--json", str(out)]) == 0
        doc = json.loads(out.read_text())
        assert doc["mode"] == "all" and doc["totals"]["checked"] == 100 + len(ZCH_KEYS)


def test_pipeline_verify_serving_takes_the_same_sample_flag():
    from deltarec.cli import build_parser

    parser = build_parser("pipeline")
    argv = ["pipeline", "verify-serving", "--artifacts", "a", "--run", "r", "--store", "s"]
    assert parser.parse_args(argv).sample == 10000
    assert parser.parse_args([*argv, "--sample", "0"]).sample == 0
    with pytest.raises(SystemExit):
        parser.parse_args([*argv, "--sample", "-1"])


def test_an_injected_zch_row_fails_the_sampled_gate(lineage, store):
    g = base_generation(lineage, store)
    assert _sampled(lineage, store).passed
    row = lineage.expected_row(lineage.T_ZCH, np.array([900]), 0.0)
    store.write(lineage.T_ZCH, np.array([900]), row, np.zeros(1, np.int8), [make_version(g, 1)])
    result = _sampled(lineage, store)
    zch = result.tables[lineage.T_ZCH]
    assert not result.passed and zch.checked == 2
    assert "1 more: rows the lineage never wrote" in zch.key_count_problem
    assert f"table {lineage.T_ZCH!r}" in result.failure_summary()


def test_a_key_missing_outside_the_sample_fails_the_sampled_gate(lineage, store):
    g = base_generation(lineage, store)
    result = _sampled(lineage, store)
    unsampled = next(k for k in range(100) if k not in _checked_keys(result, lineage.T_EMB))
    store.delete(lineage.T_EMB, np.array([unsampled]), make_version(g, 1))
    result = _sampled(lineage, store)
    emb = result.tables[lineage.T_EMB]
    assert not result.passed and emb.store_keys == 99
    assert "1 fewer: keys missing" in emb.key_count_problem


def _checked_keys(result, table):
    # the sample is seeded: the same options check the same keys; a failing one names them all
    return {m.key for m in result.tables[table].mismatches}


def test_an_older_point_is_not_counted_once_newer_dumps_are_in_the_store(lineage, store):
    g1 = base_generation(lineage, store)
    g2 = lineage.generation(parent=Parent(g1, lineage.step))  # adds emb keys 500 and 501
    lineage.dump(g2, 1, {lineage.T_EMB: (np.array([0, 500, 501]), 2.0)})
    lineage.publish(store, g2)
    older = _sampled(lineage, store, generation=g1)
    assert older.passed, older.failure_summary()
    assert NOT_COUNTED["newer"].format(run=lineage.run) in older.notes
    assert older.tables[lineage.T_EMB].store_keys is None
    # generation 2 wrote nothing into the ZCH table: its count is still the point's
    assert older.tables[lineage.T_ZCH].store_keys == len(ZCH_KEYS) - 1  # id 7 evicted
    newest = _sampled(lineage, store, generation=g2)
    assert newest.passed and newest.tables[lineage.T_EMB].store_keys == 102


def test_a_staged_generation_is_not_counted_until_promoted(lineage, store):
    if not store.capabilities.staging:
        pytest.skip(f"{store.kind} has no staging")
    g1 = lineage.first_generation()
    lineage.publish(store, g1, staged=True)
    result = _sampled(lineage, store, generation=g1)
    assert result.passed and NOT_COUNTED["staged"] in result.notes


def test_a_store_without_progress_marks_of_the_point_is_not_counted(lineage, sqlite_store):
    g = base_generation(lineage, sqlite_store, publish=False)
    sqlite_store.provision(lineage.specs)
    state_keys = np.arange(100)
    rows = lineage.expected_row(lineage.T_EMB, state_keys, 0.0)
    # rows written behind the publisher's back: no progress mark tells what the store holds
    versions = np.full(100, make_version(g, 0))
    sqlite_store.write(lineage.T_EMB, state_keys, rows, np.zeros(100, np.int8), versions)
    result = _sampled(lineage, sqlite_store)
    assert NOT_COUNTED["no marks"] in result.notes
    assert all(t.store_keys is None for t in result.tables.values())
