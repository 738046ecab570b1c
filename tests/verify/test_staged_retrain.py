"""Staged publishing of a fresh retrain: its snapshot replaces the live table at promote.

A generation that starts fresh publishes a snapshot; in ``staged`` mode the keys it lacks
(an older generation's ZCH ids, its plain-table keys) leave the live view when promote merges
the staging views, and verify checks the staged generation as it will be after that merge.
"""

import numpy as np
import pytest

from deltarec.artifacts.lineage import expected_state
from deltarec.promote import promote
from deltarec.publish import DumpPublisher
from deltarec.publish.types import PublishMode
from deltarec.verify import VerifyOptions, verify, write_record

OTHER_IDS = np.array([-1, 5, 23, 31, 40], np.int64)
"""The ZCH ids a retrain admits: ids 3, 11 and 19 of the first generation are not among them."""


def _verify(lineage, store, generation, sample):
    result = verify(
        lineage.root,
        lineage.run,
        store,
        generation=generation,
        store_url=store.describe(),
        options=VerifyOptions(sample=sample),
    )
    write_record(lineage.root, result)
    return result


def _live_keys(store, table):
    return np.sort(np.concatenate([*store.scan_keys(table), np.empty(0, np.int64)]))


def _staged_retrain(lineage, store):
    """Generation 1 staged, verified and promoted; then a fresh generation 2 staged."""
    g1 = lineage.first_generation()
    lineage.publish(store, g1, staged=True)
    assert _verify(lineage, store, g1, None).passed
    promote(lineage.root, lineage.run, store, g1)
    g2 = lineage.first_generation(
        keys=np.arange(50, 150), updated=np.arange(50, 60), zch_keys=OTHER_IDS
    )
    lineage.publish(store, g2, staged=True)
    return g1, g2


@pytest.mark.parametrize("sample", [None, 3])
def test_staged_fresh_retrain_of_a_zch_model_verifies_and_promote_replaces_the_live_tables(
    lineage, store, sample
):
    if not store.capabilities.staging:
        pytest.skip(f"{store.kind} has no staging")
    _, g2 = _staged_retrain(lineage, store)
    assert 3 in _live_keys(store, lineage.T_ZCH)  # generation 1 still serves before promote

    before = _verify(lineage, store, g2, sample)
    assert before.passed, before.failure_summary()
    assert before.staged_tables == sorted([lineage.T_EMB, lineage.T_ZCH])

    result = promote(lineage.root, lineage.run, store, g2)
    assert result.verified and result.merged_rows > 0
    state = expected_state(lineage.root, lineage.run, g2, 1)
    for table, et in state.tables.items():
        assert np.array_equal(_live_keys(store, table), et.present_keys()), table
        got = store.read(table, et.keys)
        assert np.array_equal(got.found, et.present), table
        assert np.array_equal(got.embedding[et.present], et.load(et.keys[et.present])), table
    after = verify(lineage.root, lineage.run, store, options=VerifyOptions(sample=None))
    assert after.generation == g2 and after.passed and after.staged_tables == []


def test_staged_retrain_verify_still_sees_a_row_the_snapshot_does_not_sweep(lineage, store):
    if not store.capabilities.staging:
        pytest.skip(f"{store.kind} has no staging")
    _, g2 = _staged_retrain(lineage, store)
    # A live row written behind the publisher's back at generation 2's own version survives
    # the merge's sweep, so the staged generation must not pass with it.
    stray = lineage.expected_row(lineage.T_ZCH, np.array([77]), 0.0)
    version = np.array([(g2 << 32) | 1], np.int64)
    store.write(lineage.T_ZCH, np.array([77]), stray, np.zeros(1, np.int8), version)
    result = _verify(lineage, store, g2, None)
    assert not result.passed
    assert [m.key for m in result.tables[lineage.T_ZCH].mismatches] == [77]


def test_publishing_a_promoted_staged_generation_again_leaves_no_staging_views(lineage, store):
    if not store.capabilities.staging:
        pytest.skip(f"{store.kind} has no staging")
    g1 = lineage.first_generation()
    lineage.publish(store, g1, staged=True)
    assert _verify(lineage, store, g1, None).passed
    promote(lineage.root, lineage.run, store, g1)
    assert store.views(staging_generation=g1) == {}
    # the next trainer first publishes what earlier generations left pending: nothing here
    publisher = DumpPublisher(store, lineage.root, lineage.run, mode=PublishMode.STAGED)
    assert publisher.publish_generation(g1) == []
    assert store.views(staging_generation=g1) == {}
    assert _verify(lineage, store, g1, None).staged_tables == []
