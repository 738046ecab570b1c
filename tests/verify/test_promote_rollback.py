"""Promote and rollback against real stores (SQLite, PostgreSQL, Redis)."""

import numpy as np
import pytest

from deltarec.artifacts import Op, Parent
from deltarec.artifacts.lineage import expected_state
from deltarec.errors import BadInputError
from deltarec.ids import make_version
from deltarec.promote import NotVerifiedError, promote, rollback
from deltarec.verify import RowClass, VerifyOptions, read_record, verify, write_record

from .conftest import base_generation


def _gen2(lineage, store, parent, staged=False):
    """A child: updates emb 0..4, adds emb key 500, evicts id 3, admits id 23, new fallback."""
    g = lineage.generation(parent=Parent(parent, lineage.step))
    lineage.dump(
        g,
        1,
        {
            lineage.T_EMB: (np.array([0, 1, 2, 3, 4, 500]), 2.0),
            lineage.T_ZCH: (np.array([-1, 3, 23]), 2.0, np.array([0, 1, 0])),
        },
    )
    lineage.publish(store, g, staged=staged)
    return g


def _verified(lineage, store, generation, through_seq=None, **kw):
    result = verify(
        lineage.root,
        lineage.run,
        store,
        generation=generation,
        through_seq=through_seq,
        store_url=store.describe(),
        options=VerifyOptions(**kw),
    )
    write_record(lineage.root, result)
    return result


def _assert_store_equals_expected(lineage, store, generation, seq):
    """Every key of every table in the store equals the expected state, nothing more."""
    state = expected_state(lineage.root, lineage.run, generation, seq)
    for table, et in state.tables.items():
        got = store.read(table, et.keys)
        present = et.present
        assert np.array_equal(got.found, present), table
        assert np.array_equal(got.embedding[present], et.load(et.keys[present])), table
        scanned = np.concatenate([*store.scan_keys(table), np.empty(0, np.int64)])
        assert np.array_equal(np.sort(scanned), et.present_keys()), table


def test_promote_refuses_an_unverified_generation(lineage, store):
    g = base_generation(lineage, store)
    with pytest.raises(NotVerifiedError, match="never verified"):
        promote(lineage.root, lineage.run, store, g)
    assert store.get_serving(lineage.run) is None


def test_promote_refuses_a_failed_verification_unless_forced(lineage, store):
    g = base_generation(lineage, store)
    store.delete(lineage.T_EMB, np.array([42]), make_version(g, 0))
    result = _verified(lineage, store, g, sample=None)
    assert not result.passed
    record = read_record(lineage.root, lineage.run, g, 1, store)
    assert record is not None and not record.passed and "key 42" in record.failure
    with pytest.raises(NotVerifiedError, match="key 42"):
        promote(lineage.root, lineage.run, store, g)
    forced = promote(lineage.root, lineage.run, store, g, force=True)
    assert forced.forced and not forced.verified
    pointer = store.get_serving(lineage.run)
    assert (pointer.generation, pointer.seq) == (g, 1) and "--force" in pointer.note


def test_verified_generation_is_promoted_through_its_newest_dump(lineage, store):
    g = base_generation(lineage, store)
    assert _verified(lineage, store, g, sample=30).passed
    result = promote(lineage.root, lineage.run, store, g)
    assert result.verified and not result.forced and result.merged_rows == 0
    pointer = store.get_serving(lineage.run)
    assert (pointer.generation, pointer.seq) == (g, 1) and "verified" in pointer.note
    # A verification through an earlier dump does not cover the newest one.
    with pytest.raises(NotVerifiedError):
        promote(lineage.root, lineage.run, store, g, through_seq=0)
    assert _verified(lineage, store, g, through_seq=0, sample=30).passed
    assert promote(lineage.root, lineage.run, store, g, through_seq=0).pointer.seq == 0


def test_staged_generation_is_verified_as_merged_and_promote_makes_it_live(lineage, store):
    if not store.capabilities.staging:
        pytest.skip(f"{store.kind} has no staging")
    g1 = base_generation(lineage, store)
    g2 = _gen2(lineage, store, g1, staged=True)
    live = store.read(lineage.T_EMB, np.array([0, 500]))
    assert live.found.tolist() == [True, False]  # not live before promote
    before = _verified(lineage, store, g2, sample=None)
    assert before.passed, before.failure_summary()
    assert before.staged_tables == sorted([lineage.T_EMB, lineage.T_ZCH])
    result = promote(lineage.root, lineage.run, store, g2)
    assert result.merged_rows >= 7
    live = store.read(lineage.T_EMB, np.array([0, 500]))
    assert live.found.all() and (live.versions == make_version(g2, 1)).all()
    after = verify(
        lineage.root, lineage.run, store, generation=g2, options=VerifyOptions(sample=None)
    )
    assert after.passed and after.staged_tables == []
    _assert_store_equals_expected(lineage, store, g2, 1)


def test_rollback_restores_every_key_to_the_promoted_point(lineage, store):
    g1 = base_generation(lineage, store)
    assert _verified(lineage, store, g1, sample=None).passed
    promote(lineage.root, lineage.run, store, g1)
    g2 = _gen2(lineage, store, g1)
    assert _verified(lineage, store, g2, sample=None).passed
    promote(lineage.root, lineage.run, store, g2)
    moved_on = verify(
        lineage.root, lineage.run, store, generation=g1, options=VerifyOptions(sample=None)
    )
    assert moved_on.passed and moved_on.tables[lineage.T_EMB].counts[RowClass.SUPERSEDED] == 6

    result = rollback(lineage.root, lineage.run, store, g1)
    assert (result.to_generation, result.through_seq, result.generation) == (g1, 1, 3)
    # Every key of the point is republished: emb 0..99; ids -1, 3, 11, 19 (7 was evicted).
    assert result.restored == {lineage.T_EMB: 100, lineage.T_ZCH: 4}
    assert result.came_back == {lineage.T_EMB: 0, lineage.T_ZCH: 1}  # id 3, evicted by g2
    assert result.removed == {lineage.T_EMB: 1, lineage.T_ZCH: 1}  # emb 500; id 23
    assert result.passed and result.verification.mode == "all"
    info = lineage.root.read_generation(lineage.run, 3)
    assert info.extra["rollback"]["to_generation"] == g1 and info.parent == Parent(g1, 20)

    check = verify(
        lineage.root, lineage.run, store, generation=g1, options=VerifyOptions(sample=None)
    )
    assert check.passed, check.failure_summary()
    assert check.rollback_generations == [3]
    assert check.totals()[RowClass.SUPERSEDED] == 0
    _assert_store_equals_expected(lineage, store, g1, 1)
    own = verify(lineage.root, lineage.run, store, options=VerifyOptions(sample=None))
    assert own.generation == 3 and own.passed, own.failure_summary()
    pointer = store.get_serving(lineage.run)
    assert (pointer.generation, pointer.seq) == (g1, 1) and "rollback" in pointer.note


def test_rollback_row_with_other_values_is_different(lineage, store):
    g1 = base_generation(lineage, store)
    promote(lineage.root, lineage.run, store, g1, force=True)
    _gen2(lineage, store, g1)
    r = rollback(lineage.root, lineage.run, store, g1)
    bad = lineage.expected_row(lineage.T_EMB, np.array([2]), 7.0)
    store.write(lineage.T_EMB, np.array([2]), bad, np.zeros(1, np.int8), [r.version])
    result = verify(
        lineage.root, lineage.run, store, generation=g1, options=VerifyOptions(sample=None)
    )
    (m,) = [m for m in result.tables[lineage.T_EMB].mismatches]
    assert (m.key, m.row_class, m.store_version) == (2, RowClass.DIFFERENT, r.version)
    assert "rollback" in m.reason


def test_rollback_needs_a_promoted_generation(lineage, store):
    g1 = base_generation(lineage, store)
    with pytest.raises(BadInputError, match="never promoted"):
        rollback(lineage.root, lineage.run, store, g1)


def test_rollback_with_nothing_changed_writes_no_generation(lineage, store):
    g1 = base_generation(lineage, store)
    promote(lineage.root, lineage.run, store, g1, force=True)
    result = rollback(lineage.root, lineage.run, store, g1)
    assert result.generation is None and lineage.root.list_generations(lineage.run) == [g1]
    assert store.get_serving(lineage.run).note.startswith("rollback to generation 1 dump 1")


def test_rollback_with_nothing_committed_since_still_repairs_a_store_that_lost_a_row(
    lineage, store
):
    g1 = base_generation(lineage, store)
    promote(lineage.root, lineage.run, store, g1, force=True)
    store.delete(lineage.T_EMB, np.array([42]), make_version(g1, 1))  # lost behind our back
    result = rollback(lineage.root, lineage.run, store, g1)
    assert result.passed and result.generation == 2
    assert result.came_back == {lineage.T_EMB: 1, lineage.T_ZCH: 0}
    _assert_store_equals_expected(lineage, store, g1, 1)


def test_rollback_to_an_earlier_dump_of_the_same_generation(lineage, store):
    g1 = base_generation(lineage, store)
    result = rollback(lineage.root, lineage.run, store, g1, through_seq=0)
    assert result.restored[lineage.T_EMB] == 100  # the snapshot of dump 0: emb 0..99
    rows = lineage.root.read_manifest(lineage.run, result.generation, 1)
    assert rows.tables == {lineage.T_EMB: 100, lineage.T_ZCH: 5}
    assert verify(lineage.root, lineage.run, store, generation=g1, through_seq=0).passed
    _assert_store_equals_expected(lineage, store, g1, 0)
    assert int(Op.UPSERT) == 0
