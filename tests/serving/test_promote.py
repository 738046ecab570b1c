"""Generations switch only at promote: shadow, swap in, roll back, and a failed verify."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
from tests._helpers.artifacts import Lineage

from deltarec.artifacts import Parent
from deltarec.artifacts.lineage import expected_state
from deltarec.promote import promote, rollback
from deltarec.serving.follow import Follower, FollowOptions, StorePointer
from deltarec.serving.http import ReplicaServer
from deltarec.serving.replica import Replica
from deltarec.stores import open_store
from deltarec.verify import verify, write_record

from .conftest import RUN, T_EMB, T_ZCH


def assert_replica_holds(replica, root, generation, seq):
    """Key by key, the replica holds the expected state of the point: rows and versions."""
    state = expected_state(root, RUN, generation, seq)
    with replica.pinned() as snap:
        assert (snap.position.generation, snap.position.seq) == (generation, seq)
        for table, et in state.tables.items():
            keys = et.present_keys()
            held = snap.table(table)
            np.testing.assert_array_equal(held.keys_np, keys)
            found, versions, rows = held.read(keys)
            assert found.all()
            np.testing.assert_array_equal(versions, et.versions[et.present])
            np.testing.assert_array_equal(rows, et.load(keys))


def _verified_promote(outbox, store, generation):
    result = verify(outbox.root, RUN, store, generation=generation, store_url=store.describe())
    write_record(outbox.root, result)
    assert result.passed
    return promote(outbox.root, RUN, store, generation)


def _serving_first_generation(outbox, store, store_url, *options):
    """Generation 1 published, verified and promoted; a follower of the store that polled once."""
    g1 = outbox.first_generation()
    outbox.publish(store, g1)
    _verified_promote(outbox, store, g1)
    pointer = StorePointer(store_url, outbox.root.uri, RUN)
    follower = Follower(Replica(outbox.root, RUN), pointer, *options)
    follower.poll()
    return g1, follower


def _child(outbox, store, parent):
    g = outbox.generation(parent=Parent(parent, outbox.step))
    outbox.dump(
        g, 1, {T_EMB: (np.array([0, 1, 500]), 5.0), T_ZCH: (np.array([3, 23]), 5.0, [1, 0])}
    )
    outbox.publish(store, g)
    return g


def test_a_newer_generation_is_shadowed_until_promoted_then_swapped_in(outbox, store, store_url):
    g1, follower = _serving_first_generation(outbox, store, store_url)
    assert_replica_holds(follower.replica, outbox.root, g1, 1)
    g2 = _child(outbox, store, g1)
    follower.poll()
    assert follower.status().shadow == {"generation": g2, "seq": 1}
    assert_replica_holds(follower.replica, outbox.root, g1, 1)  # not promoted: not served
    _verified_promote(outbox, store, g2)
    follower.poll()
    assert_replica_holds(follower.replica, outbox.root, g2, 1)
    assert follower.status().shadow is None
    follower.pointer_source.close()


def test_rollback_swaps_the_previous_generation_back_in(outbox, store, store_url):
    g1, follower = _serving_first_generation(outbox, store, store_url)
    g2 = _child(outbox, store, g1)
    _verified_promote(outbox, store, g2)
    follower.poll()
    previous = follower.replica.previous
    result = rollback(outbox.root, RUN, store, g1)
    assert result.generation is not None  # a rollback generation was written
    follower.poll()
    assert follower.replica.line is previous  # swapped back, not reloaded
    assert_replica_holds(follower.replica, outbox.root, g1, 1)
    follower.poll()  # the rollback generation is never followed nor shadowed
    assert follower.status().shadow is None and follower.status().seq == 1
    follower.pointer_source.close()


def test_a_generation_that_fails_verify_is_never_served(outbox, store, store_url):
    g1, follower = _serving_first_generation(outbox, store, store_url, FollowOptions(follow=True))
    g2 = outbox.generation(parent=Parent(g1, outbox.step))
    outbox.dump(g2, 1, {T_EMB: (np.array([7]), 9.0)})  # committed but never published
    result = verify(outbox.root, RUN, store, generation=g2, store_url=store.describe())
    assert not result.passed
    rollback(outbox.root, RUN, store, g1, through_seq=1)  # what the pipeline does on FAIL
    for _ in range(2):
        follower.poll()
    assert_replica_holds(follower.replica, outbox.root, g1, 1)
    follower.pointer_source.close()


def _dense_dump(outbox, g, seq, rows, value):
    """Commit a dump that carries a dense state of ``value`` (through the commit's root)."""
    import io

    import torch

    from deltarec.artifacts.dense import DenseCapture, DenseCommitRoot

    def payload() -> bytes:
        buf = io.BytesIO()
        torch.save({"over.weight": torch.full((2,), value)}, buf)
        return buf.getvalue()

    capture = DenseCapture()
    capture.settle(outbox.step + 10, payload)
    plain, outbox.root = outbox.root, DenseCommitRoot(outbox.root.uri, None, capture)
    try:
        return outbox.dump(g, seq, rows)
    finally:
        outbox.root = plain


def test_promote_and_rollback_move_dense_and_sparse_together(outbox, store, store_url):
    g1 = outbox.generation()
    _dense_dump(outbox, g1, 0, {T_EMB: (np.arange(20), 0.0)}, 1.0)
    outbox.publish(store, g1)
    _verified_promote(outbox, store, g1)
    follower = Follower(Replica(outbox.root, RUN), StorePointer(store_url, outbox.root.uri, RUN))
    follower.poll()
    g2 = outbox.generation(parent=Parent(g1, outbox.step))
    _dense_dump(outbox, g2, 1, {T_EMB: (np.array([1, 2]), 2.0)}, 2.0)
    outbox.publish(store, g2)
    follower.poll()

    def served():
        with follower.replica.pinned() as snap:
            rows = snap.table(T_EMB).read(np.array([1]))[2]
            return snap.position.generation, float(snap.dense.tensors["over.weight"][0]), rows

    gen, dense, row = served()
    assert (gen, dense) == (g1, 1.0)  # g2 is only a shadow: neither half of it is served
    _verified_promote(outbox, store, g2)
    follower.poll()
    gen, dense, row = served()
    assert (gen, dense) == (g2, 2.0)
    np.testing.assert_array_equal(row[0], outbox.expected_row(T_EMB, np.array([1]), 2.0)[0])
    rollback(outbox.root, RUN, store, g1)
    follower.poll()
    gen, dense, row = served()
    assert (gen, dense) == (g1, 1.0)
    np.testing.assert_array_equal(row[0], outbox.expected_row(T_EMB, np.array([1]), 0.0)[0])
    follower.pointer_source.close()


def test_a_replica_of_a_run_that_no_longer_serves_is_not_ready_and_names_the_run_that_does(
    outbox, store, store_url
):
    g1, follower = _serving_first_generation(outbox, store, store_url)
    assert follower.readiness() == (True, "ready") and follower.status().serves is True
    other = Lineage(outbox.root, run="two")
    with open_store(store_url, outbox.root.uri, run="two") as two:
        o1 = other.first_generation()
        other.publish(two, o1)
        result = verify(other.root, "two", two, generation=o1, store_url=two.describe())
        write_record(other.root, result)
        promote(other.root, "two", two, o1)  # two takes serving over
    follower.poll()
    ready, why = follower.readiness()
    assert not ready
    assert why == f"not ready: run {RUN!r} does not serve: serving is run 'two' generation 1 dump 1"
    with ReplicaServer(follower) as server:  # what the readiness probe and a client see
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/v1/status") as answer:
            status = json.loads(answer.read())
        with pytest.raises(urllib.error.HTTPError) as probe:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/readyz")
        assert probe.value.code == 503 and probe.value.read().decode().strip() == why
    assert (status["ready"], status["serves"]) == (False, False)
    assert set(status["serving"]["tables"].values()) == {"two"}
    assert status["serving"]["runs"] == {"two": {"generation": 1, "seq": 1}}
    assert_replica_holds(follower.replica, outbox.root, g1, 1)  # rows kept, not advertised
    rollback(outbox.root, RUN, store, g1)  # RUN serves again
    follower.poll()
    assert follower.readiness() == (True, "ready")
    follower.pointer_source.close()
