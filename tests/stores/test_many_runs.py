"""Many runs, one store (docs/runs.md): no run's rows are lost to another run's versions.

Two runs with other seeds publish interleaved generations into one store (run ``one`` ends at
generation 2, whose versions are above every version of run ``two``'s generation 1, the case
where the runless layout dropped two's rows). After each publish every run's rows are compared,
key by key, with the run's own expected state; serving follows promote and rollback exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.lineage import expected_state
from deltarec.artifacts.types import DType, DumpKind, Parent, TableKind, TableSpec
from deltarec.errors import BadInputError, ConfigError
from deltarec.publish import DumpPublisher
from deltarec.stores import open_store
from deltarec.testing.dumps import new_generation, random_rows, write_dump
from deltarec.verify import VerifyOptions, verify
from deltarec.verify.types import RowClass

T = "sparse.ebc.user_id"
Z = "sparse.zch.ad_id"
TABLES = {
    T: TableSpec(dim=8, num_embeddings=1000),
    Z: TableSpec(dim=4, dtype=DType.FLOAT16, kind=TableKind.ZCH),
}


def _dump(root, info, seq, seed, kind=DumpKind.DELTA):
    """Keys of T from a seeded draw; ZCH ids with one eviction (op 1) per dump."""
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(0, 1000, 300))
    zkeys = np.array([-1, 100 + seq, 200 + seq], np.int64)
    zops = np.array([0, 0, 1], np.int8)
    rows = {
        T: {0: random_rows(keys, TABLES[T], seed)},
        Z: {0: random_rows(zkeys, TABLES[Z], seed + 1, zops)},
    }
    return write_dump(root, info, seq, rows, kind=kind, first_step=seq * 10, last_step=seq * 10)


def _publish(url, root, run, manifest):
    with open_store(url, run=run) as store:
        DumpPublisher(store, root, run).publish_dump(manifest, 0)


def _assert_holds(store, root, run, generation):
    """Every key of ``run``'s expected state at ``generation`` is in ``store`` exactly."""
    state = expected_state(root, run, generation)
    for table, et in state.tables.items():
        keys = et.present_keys()
        got = store.read(table, keys)
        assert got.found.all(), f"{run} {table}: {int((~got.found).sum())} keys missing"
        np.testing.assert_array_equal(got.embedding, et.load(keys), err_msg=f"{run} {table}")
        np.testing.assert_array_equal(got.versions, et.versions[et.index_of(keys)])
        gone = et.keys[~et.present]
        assert not store.read(table, gone).found.any(), f"{run} {table}: evicted ids held"


def _check_verify(url, root, run):
    with open_store(url, run=run) as store:
        result = verify(root, run, store, options=VerifyOptions(sample=None))
    totals = result.totals()
    assert result.passed, result.failure_summary()
    assert totals[RowClass.MATCH] == result.checked > 0
    assert totals[RowClass.SUPERSEDED] == 0


def test_two_runs_publishing_interleaved_keep_every_row_of_each(backend, tmp_path):
    root = ArtifactRoot(str(tmp_path / "art"))
    url = backend.url
    one1 = new_generation(root, "one", TABLES, world_size=1)
    two1 = new_generation(root, "two", TABLES, world_size=1)
    _publish(url, root, "one", _dump(root, one1, 0, seed=1, kind=DumpKind.SNAPSHOT))
    _publish(url, root, "two", _dump(root, two1, 0, seed=2, kind=DumpKind.SNAPSHOT))
    _publish(url, root, "one", _dump(root, one1, 1, seed=3))
    one2 = new_generation(root, "one", TABLES, world_size=1, parent=Parent(1, 10))
    _publish(url, root, "one", _dump(root, one2, 1, seed=4))  # versions above all of two's
    _publish(url, root, "two", _dump(root, two1, 1, seed=5))
    _publish(url, root, "two", _dump(root, two1, 2, seed=6))

    for run, generation in (("one", 2), ("two", 1)):
        with open_store(url, run=run) as store:
            _assert_holds(store, root, run, generation)
        _check_verify(url, root, run)

    with open_store(url) as serving:  # the first run to provision serves until a promote
        assert serving.registry.serving_runs() == {T: "one", Z: "one"}
        _assert_holds(serving, root, "one", 2)
    with open_store(url, run="two") as store:
        store.registry.set_serving("two", 1, 2)
    with open_store(url) as serving:
        assert serving.registry.serving_runs() == {T: "two", Z: "two"}
        _assert_holds(serving, root, "two", 1)
    _publish(url, root, "one", _dump(root, one2, 2, seed=7))  # one goes on, unseen by serving
    with open_store(url) as serving:
        _assert_holds(serving, root, "two", 1)
    with open_store(url, run="one") as store:
        _assert_holds(store, root, "one", 2)
        store.registry.set_serving("one", 2, 2)
    with open_store(url) as serving:
        _assert_holds(serving, root, "one", 2)
    _check_verify(url, root, "two")


def test_a_store_handle_without_a_run_reads_serving_and_refuses_writes(backend, tmp_path):
    with open_store(backend.url, run="one") as store:
        store.provision(TABLES)
    with open_store(backend.url) as serving:
        assert set(serving.views()) == {T, Z}
        with pytest.raises(BadInputError, match="needs a run"):
            serving.provision(TABLES)
        with pytest.raises(BadInputError, match="needs a run"):
            serving.write(
                T, np.array([1]), np.zeros((1, 8), np.float32), np.zeros(1, np.int8), [1 << 32]
            )


def test_a_publisher_refuses_a_store_handle_of_another_run(backend, tmp_path):
    root = ArtifactRoot(str(tmp_path / "art"))
    with open_store(backend.url, run="one") as store, pytest.raises(ConfigError, match="'two'"):
        DumpPublisher(store, root, "two")


def test_verify_names_a_newer_version_no_dump_of_the_run_wrote(backend, tmp_path):
    root = ArtifactRoot(str(tmp_path / "art"))
    info = new_generation(root, "one", TABLES, world_size=1)
    manifest = _dump(root, info, 1, seed=1)
    _publish(backend.url, root, "one", manifest)
    key = int(expected_state(root, "one", 1).tables[T].present_keys()[0])
    foreign = (5 << 32) | 9  # a version run one never wrote (another lineage's)
    with open_store(backend.url, run="one") as store:
        store.write(
            T, np.array([key]), np.ones((1, 8), np.float32), np.zeros(1, np.int8), [foreign]
        )
        result = verify(root, "one", store, options=VerifyOptions(sample=None))
    assert not result.passed
    (bad,) = [m for m in result.tables[T].mismatches if m.key == key]
    assert bad.row_class is RowClass.DIFFERENT and bad.store_version == foreign
    assert "generation 5, dump 9" in bad.reason and "'one'" in bad.reason
    assert result.tables[T].counts[RowClass.SUPERSEDED] == 0


def test_a_verify_that_matched_no_key_fails_though_no_class_fails(backend, tmp_path):
    root = ArtifactRoot(str(tmp_path / "art"))
    spec = {T: TABLES[T]}
    first = new_generation(root, "one", spec, world_size=1)
    old = write_dump(root, first, 1, {T: {0: random_rows(range(50), TABLES[T], seed=1)}})
    second = new_generation(root, "one", spec, world_size=1, parent=Parent(1, 1))
    new = write_dump(root, second, 1, {T: {0: random_rows(range(50), TABLES[T], seed=2)}})
    _publish(backend.url, root, "one", old)
    _publish(backend.url, root, "one", new)
    with open_store(backend.url, run="one") as store:
        result = verify(root, "one", store, generation=1, options=VerifyOptions(sample=None))
    assert result.totals()[RowClass.SUPERSEDED] == 50 and result.totals()[RowClass.MATCH] == 0
    assert not result.passed
    assert "no key matched" in result.failure_summary()
