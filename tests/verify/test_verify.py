"""Verification against real stores (SQLite, PostgreSQL, Redis), artifacts built directly."""

import numpy as np
import pytest

from deltarec.artifacts import Parent
from deltarec.errors import BadInputError
from deltarec.ids import make_version
from deltarec.verify import RowClass, VerifyOptions, verify

from .conftest import base_generation, tamper


def _by_class(table_result, cls):
    return sorted(m.key for m in table_result.mismatches if m.row_class is cls)


def test_published_generation_verifies_with_every_key_matching(lineage, store):
    g = base_generation(lineage, store)
    result = verify(
        lineage.root, lineage.run, store, generation=g, options=VerifyOptions(sample=None)
    )
    assert result.passed, result.failure_summary()
    emb = result.tables[lineage.T_EMB]
    assert emb.checked == 100 and emb.counts[RowClass.MATCH] == 100
    assert emb.store_keys_scanned == 100
    zch = result.tables[lineage.T_ZCH]
    assert zch.expected_keys == 5 and zch.expected_present == 4
    assert zch.counts[RowClass.MATCH] == 5 and zch.max_abs_diff == 0.0
    assert result.shards_checked == 4 and not result.shard_failures
    assert [d.seq for d in result.dumps] == [0, 1]
    assert result.through_seq == 1 and result.version == make_version(g, 1)


def test_tampered_row_is_different_and_deleted_row_is_missing_naming_keys(lineage, store):
    g = base_generation(lineage, store)
    tamper(lineage, store, g, changed=3, deleted=42)
    result = verify(
        lineage.root, lineage.run, store, generation=g, options=VerifyOptions(sample=None)
    )
    emb = result.tables[lineage.T_EMB]
    assert not result.passed
    assert emb.counts[RowClass.DIFFERENT] == 1 and emb.counts[RowClass.MISSING] == 1
    assert emb.counts[RowClass.MATCH] == 98
    assert _by_class(emb, RowClass.DIFFERENT) == [3]
    assert _by_class(emb, RowClass.MISSING) == [42]
    # Worst first: a missing row outranks any value difference.
    assert [m.key for m in emb.mismatches] == [42, 3]
    diff = emb.mismatches[1]
    assert diff.max_abs_diff > 0 and diff.tolerance == 0.0 and diff.reason == "values differ"
    assert "key 3" in result.failure_summary()


def test_row_the_lineage_never_wrote_fails_a_sample_by_its_count_and_all_names_it(lineage, store):
    g = base_generation(lineage, store)
    row = lineage.expected_row(lineage.T_EMB, np.array([5000]), 0.0)
    store.write(lineage.T_EMB, np.array([5000]), row, np.zeros(1, np.int8), [make_version(g, 0)])
    sampled = verify(
        lineage.root, lineage.run, store, generation=g, options=VerifyOptions(sample=50, seed=1)
    )
    emb = sampled.tables[lineage.T_EMB]
    assert emb.checked == 50 and emb.counts[RowClass.UNEXPECTED] == 0  # not in the sample
    assert not sampled.passed and emb.store_keys == 101
    assert "holds 101 keys, the expected state 100 (1 more" in sampled.failure_summary()
    assert sampled.tables[lineage.T_ZCH].key_count_problem == ""
    full = verify(
        lineage.root, lineage.run, store, generation=g, options=VerifyOptions(sample=None)
    )
    emb = full.tables[lineage.T_EMB]
    assert not full.passed
    assert emb.counts[RowClass.UNEXPECTED] == 1 and emb.store_keys_scanned == 101
    (m,) = emb.mismatches
    assert (m.key, m.expected_version, m.store_version) == (5000, None, make_version(g, 0))


def test_unpublished_dump_shows_stale_rows_and_evicted_id_still_served(lineage, store):
    g = base_generation(lineage, store, publish=False)
    lineage.publish(store, g, seqs=[0])
    result = verify(
        lineage.root, lineage.run, store, generation=g, options=VerifyOptions(sample=None)
    )
    emb, zch = result.tables[lineage.T_EMB], result.tables[lineage.T_ZCH]
    assert emb.counts[RowClass.DIFFERENT] == 10
    assert {m.reason for m in emb.mismatches} == {"stale version"}
    assert _by_class(zch, RowClass.UNEXPECTED) == [7]
    assert _by_class(zch, RowClass.DIFFERENT) == [-1]
    # Through the published dump only, everything matches.
    assert verify(lineage.root, lineage.run, store, generation=g, through_seq=0).passed


def test_rows_of_a_newer_generation_are_superseded_and_do_not_fail(lineage, store):
    g1 = base_generation(lineage, store)
    g2 = lineage.generation(parent=Parent(g1, lineage.step))
    lineage.dump(g2, 1, {lineage.T_EMB: (np.arange(5), 2.0), lineage.T_ZCH: (np.array([23]), 2.0)})
    lineage.publish(store, g2)
    old = verify(
        lineage.root, lineage.run, store, generation=g1, options=VerifyOptions(sample=None)
    )
    assert old.passed, old.failure_summary()
    assert old.tables[lineage.T_EMB].counts[RowClass.SUPERSEDED] == 5
    assert old.tables[lineage.T_ZCH].counts[RowClass.SUPERSEDED] == 1  # id 23, newer
    new = verify(lineage.root, lineage.run, store, options=VerifyOptions(sample=None))
    assert new.generation == g2 and new.passed, new.failure_summary()
    assert new.tables[lineage.T_EMB].counts[RowClass.MATCH] == 100
    assert [(d.generation, d.seq) for d in new.dumps] == [(g1, 0), (g1, 1), (g2, 1)]


def test_flipped_byte_in_a_shard_fails_naming_the_shard(lineage, store):
    g = base_generation(lineage, store)
    path = lineage.root.shard_path(lineage.run, g, 1, lineage.T_EMB, 0)
    lineage.flip_byte(path)
    result = verify(
        lineage.root, lineage.run, store, generation=g, options=VerifyOptions(sample=None)
    )
    assert not result.passed
    (failure,) = result.shard_failures
    assert failure.path.endswith("dump-000001/sparse.ebc.user_id/rank-00000.parquet")
    assert (failure.generation, failure.seq, failure.table) == (g, 1, lineage.T_EMB)
    assert "sha256" in failure.problem
    assert "rank-00000.parquet" in result.failure_summary()


def test_sample_is_seeded_per_table(lineage, store):
    g = base_generation(lineage, store)
    a = verify(
        lineage.root, lineage.run, store, generation=g, options=VerifyOptions(sample=20, seed=7)
    )
    b = verify(
        lineage.root, lineage.run, store, generation=g, options=VerifyOptions(sample=20, seed=7)
    )
    emb_a, emb_b = a.tables[lineage.T_EMB], b.tables[lineage.T_EMB]
    assert emb_a.checked == 20 and emb_a.live_by_version == emb_b.live_by_version
    others = [
        verify(
            lineage.root, lineage.run, store, generation=g, options=VerifyOptions(sample=20, seed=s)
        )
        .tables[lineage.T_EMB]
        .live_by_version
        for s in range(8, 12)
    ]
    assert any(o != emb_a.live_by_version for o in others)
    assert a.tables[lineage.T_ZCH].checked == 5  # smaller than the sample: every key


def test_unknown_generation_or_dump_is_bad_input(lineage, store):
    g = base_generation(lineage, store)
    with pytest.raises(BadInputError, match="no generation 9"):
        verify(lineage.root, lineage.run, store, generation=9)
    with pytest.raises(BadInputError, match="no committed dump 5"):
        verify(lineage.root, lineage.run, store, generation=g, through_seq=5)


def test_one_pass_scan_and_lookups_by_key_agree(lineage, store):
    g = base_generation(lineage, store)
    tamper(lineage, store, g, changed=4, deleted=60, stray=777)
    by_scan = verify(lineage.root, lineage.run, store, options=VerifyOptions(sample=None))
    by_key = verify(
        lineage.root, lineage.run, store, options=VerifyOptions(sample=None, full_scan_bytes=0)
    )
    for result in (by_scan, by_key):
        emb = result.tables[lineage.T_EMB]
        assert emb.checked == 101 and emb.store_keys_scanned == 100
        assert sorted((m.key, m.row_class.value) for m in emb.mismatches) == [
            (4, "DIFFERENT"),
            (60, "MISSING"),
            (777, "UNEXPECTED"),
        ]
    assert by_scan.tables[lineage.T_ZCH].counts == by_key.tables[lineage.T_ZCH].counts


def test_the_first_table_s_scan_starts_before_the_expected_state_and_is_read_once(
    lineage, store, monkeypatch
):
    """With every key checked, the first table's store scan starts before the shards are read
    (it runs on a thread meanwhile); each table is scanned once, by the one pass or not at all."""
    import deltarec.verify.engine as engine

    g = base_generation(lineage, store)
    tamper(lineage, store, g, changed=4, deleted=60, stray=777)
    events: list[str] = []
    real_scan, real_state = store.scan_rows, engine.expected_state

    def scan_rows(table, batch_rows=65536):
        events.append(f"scan {table}")
        return real_scan(table, batch_rows)

    def expected_state(*args, **kwargs):
        events.append("state")
        return real_state(*args, **kwargs)

    monkeypatch.setattr(store, "scan_rows", scan_rows)
    monkeypatch.setattr(engine, "expected_state", expected_state)
    first, second = sorted([lineage.T_EMB, lineage.T_ZCH])
    by_scan = verify(lineage.root, lineage.run, store, options=VerifyOptions(sample=None))
    assert events == [f"scan {first}", "state", f"scan {second}"]
    events.clear()
    by_key = verify(  # no one pass: the scan started early is closed unread
        lineage.root, lineage.run, store, options=VerifyOptions(sample=None, full_scan_bytes=0)
    )
    assert events == [f"scan {first}", "state"]
    for result in (by_scan, by_key):
        emb = result.tables[lineage.T_EMB]
        assert sorted((m.key, m.row_class.value) for m in emb.mismatches) == [
            (4, "DIFFERENT"),
            (60, "MISSING"),
            (777, "UNEXPECTED"),
        ]


@pytest.mark.parametrize("sample", [None, 20])
def test_verify_opens_each_small_shard_once_and_still_checks_every_shard(
    lineage, sqlite_store, monkeypatch, sample
):
    from collections import Counter

    from deltarec.artifacts import ArtifactRoot

    g = base_generation(lineage, sqlite_store)
    opened: Counter[str] = Counter()
    real_open, real_read = ArtifactRoot.open_listed, ArtifactRoot.read_listed

    def counting(self, dump_dir, path):
        opened[f"{dump_dir}/{path}"] += 1
        return real_open(self, dump_dir, path)

    def reading(self, dump_dir, path, limit):
        opened[f"{dump_dir}/{path}"] += 1
        return real_read(self, dump_dir, path, limit)

    monkeypatch.setattr(ArtifactRoot, "open_listed", counting)
    monkeypatch.setattr(ArtifactRoot, "read_listed", reading)
    result = verify(
        lineage.root, lineage.run, sqlite_store, generation=g, options=VerifyOptions(sample=sample)
    )
    assert result.passed, result.failure_summary()
    assert result.shards_checked == 4 and len(opened) == 4
    assert set(opened.values()) == {1}, opened
