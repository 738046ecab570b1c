"""Rollback restores the exact expected state of the target, whatever came after it.

Regression: a fresh retrain's snapshot removes every key it lacks (for a ZCH table, every id
the new run has not admitted); rollback used to restore only keys newer dumps wrote, so those
ids stayed gone while rollback reported success.
"""

import sys

import numpy as np
import pytest
from tests._helpers.artifacts import Lineage

from deltarec.artifacts.lineage import expected_state
from deltarec.promote import RollbackCheckError, promote, rollback, who_serves
from deltarec.stores import open_store
from deltarec.verify import RowClass, VerifyOptions, verify, write_record

from .conftest import base_generation

FRESH_EMB = np.arange(50, 150)
FRESH_ZCH = np.array([-1, 5, 11, 40])


def _verified_promote(lineage, store, generation):
    result = verify(
        lineage.root, lineage.run, store, generation=generation,
        store_url=store.describe(), options=VerifyOptions(sample=None),
    )  # fmt: skip
    write_record(lineage.root, result)
    assert result.passed, result.failure_summary()
    return promote(lineage.root, lineage.run, store, generation)


def _fresh_retrain(lineage, store):
    """A generation with no parent: its snapshot holds emb 50..149 and ZCH ids -1, 5, 11, 40."""
    g = lineage.first_generation(keys=FRESH_EMB, updated=FRESH_EMB[:10], zch_keys=FRESH_ZCH)
    lineage.publish(store, g)
    return g


def assert_store_equals(lineage, store, generation, seq):
    """Key by key, the run's views hold exactly the point's expected state, nothing more."""
    state = expected_state(lineage.root, lineage.run, generation, seq)
    for table, et in state.tables.items():
        got = store.read(table, et.keys)
        assert np.array_equal(got.found, et.present), table
        present = et.present
        assert np.array_equal(got.embedding[present], et.load(et.keys[present])), table
        scanned = np.concatenate([*store.scan_keys(table), np.empty(0, np.int64)])
        assert np.array_equal(np.sort(scanned), et.present_keys()), table


def test_rollback_after_a_fresh_retrain_brings_back_the_keys_its_snapshot_removed(lineage, store):
    g1 = base_generation(lineage, store)
    _verified_promote(lineage, store, g1)
    g2 = _fresh_retrain(lineage, store)
    _verified_promote(lineage, store, g2)
    gone = store.read(lineage.T_ZCH, np.array([3, 19]))
    assert not gone.found.any()  # the fresh snapshot removed the ids it did not admit

    result = rollback(lineage.root, lineage.run, store, g1)

    assert result.passed and result.verification.mode == "all"
    assert result.came_back == {lineage.T_EMB: 50, lineage.T_ZCH: 2}  # emb 0..49; ids 3, 19
    assert result.removed == {lineage.T_EMB: 50, lineage.T_ZCH: 2}  # emb 100..149; ids 5, 40
    assert_store_equals(lineage, store, g1, 1)
    check = verify(
        lineage.root, lineage.run, store, generation=g1, options=VerifyOptions(sample=None)
    )
    assert check.passed and check.totals()[RowClass.SUPERSEDED] == 0
    assert check.totals()[RowClass.MISSING] == 0
    pointer = store.registry.get_serving(lineage.run)
    assert (pointer.generation, pointer.seq) == (g1, 1)


def test_rollback_back_to_the_fresh_generation_after_rolling_away_from_it(lineage, store):
    g1 = base_generation(lineage, store)
    _verified_promote(lineage, store, g1)
    g2 = _fresh_retrain(lineage, store)
    _verified_promote(lineage, store, g2)
    rollback(lineage.root, lineage.run, store, g1)
    again = rollback(lineage.root, lineage.run, store, g2)
    assert again.passed and again.came_back[lineage.T_ZCH] == 2  # ids 5, 40
    assert_store_equals(lineage, store, g2, 1)


def test_rollback_of_a_run_takes_serving_back_from_another_run(lineage, store_url, tmp_path):
    other = Lineage(lineage.root, run="two")
    with open_store(store_url, lineage.root.uri, run=lineage.run) as one:
        g1 = base_generation(lineage, one)
        _verified_promote(lineage, one, g1)
    with open_store(store_url, lineage.root.uri, run="two") as two:
        o1 = other.first_generation(keys=np.arange(500, 520), zch_keys=np.array([-1, 60]))
        other.publish(two, o1)
        _verified_promote(other, two, o1)
        assert who_serves(two).runs == ["two"]
    with open_store(store_url, lineage.root.uri, run=lineage.run) as one:
        result = rollback(lineage.root, lineage.run, one, g1)
        assert result.generation is None  # nothing of run one changed since its point
        assert result.serving_before.runs == ["two"] and result.serving_after.runs == [lineage.run]
        assert_store_equals(lineage, one, g1, 1)
    with open_store(store_url, lineage.root.uri) as serving:  # what serving reads
        got = serving.read(lineage.T_EMB, np.array([0, 500]))
        assert got.found.tolist() == [True, False]  # run two's keys are not served any more


def test_rollback_that_leaves_the_store_unequal_fails_naming_what_differs(
    lineage, store, monkeypatch
):
    g1 = base_generation(lineage, store)
    _verified_promote(lineage, store, g1)
    _fresh_retrain(lineage, store)
    monkeypatch.setattr(store, "sweep_below", lambda table, version: None)  # a lost removal
    with pytest.raises(
        RollbackCheckError,
        match=r"50 key\(s\) still hold a newer dump's row.*SUPERSEDED.*e\.g\. key 100",
    ) as err:
        rollback(lineage.root, lineage.run, store, g1)
    assert not err.value.result.passed
    assert "generation 1 dump 1" in str(err.value)


@pytest.mark.parametrize("streamed", [True, False])
def test_rollback_writes_the_same_rows_streamed_from_the_shards_or_loaded_by_key_in_chunks(
    lineage, sqlite_store, monkeypatch, streamed
):
    module = sys.modules["deltarec.promote.rollback"]

    store = sqlite_store
    g1 = base_generation(lineage, store)
    _verified_promote(lineage, store, g1)
    _verified_promote(lineage, store, _fresh_retrain(lineage, store))
    monkeypatch.setattr(module, "CHUNK_KEYS", 7)  # many chunks, across shards and row groups
    monkeypatch.setattr(module, "DEFAULT_LOAD_CHUNK", 7)
    if not streamed:  # a table over the budget is loaded by key
        monkeypatch.setattr(module, "DEFAULT_FULL_SCAN_BYTES", 0)
    result = rollback(lineage.root, lineage.run, store, g1)
    assert result.passed
    assert_store_equals(lineage, store, g1, 1)
