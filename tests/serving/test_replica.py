"""The replica: the promoted point in memory, dumps applied in order and atomically, restarts."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from deltarec.artifacts import DumpKind, codec
from deltarec.serving.follow import FixedPointer, Follower, FollowOptions
from deltarec.serving.replica import Replica
from deltarec.serving.types import DuplicateDumpError, GapError, NotReadyError, OutOfOrderError
from deltarec.stores.types import ServingPointer

from .conftest import RUN, T_EMB, T_ZCH, values


def _follower(outbox, generation, seq, state_dir=None, follow=True):
    replica = Replica(outbox.root, RUN)
    pointer = FixedPointer(ServingPointer(RUN, generation, seq, 1.0))
    options = FollowOptions(follow=follow, state_dir=state_dir)
    return Follower(replica, pointer, options)


def test_replica_serves_the_promoted_point_exactly_when_not_following(outbox):
    g = outbox.first_generation()
    f = _follower(outbox, g, 0, follow=False)
    f.poll()
    found, versions, rows = f.replica.read(T_EMB, np.array([0, 9, 49, 50]))
    assert found.tolist() == [True, True, True, False]
    assert (versions[:3] == (g << 32 | 0)).all()
    np.testing.assert_array_equal(rows[:3], outbox.expected_row(T_EMB, np.array([0, 9, 49]), 0.0))
    assert f.status().seq == 0 and f.status().lag_dumps == 1


def test_following_applies_upserts_and_deletes_in_version_order(outbox):
    g = outbox.first_generation()
    f = _follower(outbox, g, 0)
    f.poll()
    assert f.status().seq == 1
    found, versions, rows = f.replica.read(T_ZCH, np.array([-1, 3, 7, 11]))
    assert found.tolist() == [True, True, False, True]  # id 7 evicted by dump 1 (op = 1)
    assert versions[0] == (g << 32 | 1) and versions[1] == (g << 32 | 0)
    np.testing.assert_array_equal(rows[0], outbox.expected_row(T_ZCH, np.array([-1]), 1.0)[0])
    outbox.dump(g, 2, {T_EMB: (np.array([5, 60]), 2.0, [1, 0])})
    f.poll()
    found, versions, _ = f.replica.read(T_EMB, np.array([5, 60, 6]))
    assert found.tolist() == [False, True, True]
    assert versions[1] == (g << 32 | 2) and versions[2] == (g << 32 | 1)


def test_quantized_rows_are_held_as_stored_and_decoded_on_lookup(outbox):
    g = outbox.first_generation()
    f = _follower(outbox, g, 1)
    f.poll()
    with f.replica.pinned() as snap:
        state = snap.table(T_ZCH)
        assert state.storage.dtype == torch.uint8 and state.storage.shape[1] == 4 + 4
    got = f.replica.lookup(T_ZCH, np.array([3, 999]))  # 999 is not held: key -1's row
    expected = codec.decode(outbox.expected_row(T_ZCH, np.array([3, -1]), 0.0), "int8_rowwise", 4)
    fallback = outbox.expected_row(T_ZCH, np.array([-1]), 1.0)
    expected[1] = codec.decode(fallback, "int8_rowwise", 4)[0]
    np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=1e-6)
    plain = f.replica.lookup(T_EMB, np.array([1000]))  # a plain table answers zeros
    assert plain.abs().sum().item() == 0


def test_a_missing_dump_stops_the_replica_naming_it_until_it_is_committed(outbox):
    g = outbox.first_generation()
    f = _follower(outbox, g, 1)
    f.poll()
    outbox.dump(g, 2, {T_EMB: (np.array([1]), 2.0)})
    outbox.dump(g, 3, {T_EMB: (np.array([1]), 3.0)})
    kept = outbox.root.dump_dir(RUN, g, 2)
    os.rename(kept, kept + ".removed")
    f.poll()
    st = f.status()
    assert st.seq == 1 and "dump 2 is missing" in st.blocked and "gap" in st.blocked
    _, versions, _ = f.replica.read(T_EMB, np.array([1]))
    assert versions[0] == (g << 32 | 1)  # still the last good point
    os.rename(kept + ".removed", kept)
    f.poll()
    assert f.status().seq == 3 and f.status().blocked is None


def test_a_duplicate_an_older_or_a_skipping_dump_is_refused(outbox):
    g = outbox.first_generation()
    outbox.dump(g, 2, {T_EMB: (np.array([1]), 2.0)})
    replica = Replica(outbox.root, RUN)
    replica.install(replica.load(g, 1))
    m0, m1, m2 = (outbox.root.read_manifest(RUN, g, s) for s in (0, 1, 2))
    with pytest.raises(DuplicateDumpError, match="already applied"):
        replica.apply(m1)
    with pytest.raises(OutOfOrderError, match="older"):
        replica.apply(m0)
    replica.apply(m2)
    outbox.dump(g, 4, {T_EMB: (np.array([1]), 4.0)})
    with pytest.raises(GapError) as e:
        replica.apply(outbox.root.read_manifest(RUN, g, 4))
    assert e.value.missing == 3 and replica.current.position.seq == 2


def test_lookups_see_every_table_of_a_dump_or_none_while_dumps_are_applied(outbox):
    g = outbox.generation()
    keys = np.arange(200)
    outbox.dump(g, 0, {T_EMB: (keys, 0.0), T_ZCH: (keys, 0.0)}, kind=DumpKind.SNAPSHOT)
    replica = Replica(outbox.root, RUN)
    replica.install(replica.load(g, 0))
    salts = {round(float(values(np.array([0]), s, 8)[0, 0]), 5): s for s in range(40)}
    seen, torn = set(), []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            with replica.pinned() as snap:
                _, emb_versions, emb = snap.table(T_EMB).read(keys)
                zch_versions = snap.table(T_ZCH).read(keys)[1]
            salt = salts.get(round(float(emb[0, 0]), 5))
            same = (
                (emb == outbox.expected_row(T_EMB, keys, salt)).all() if salt is not None else False
            )
            seen.add(salt)
            one_dump = set(emb_versions.tolist()) | set(zch_versions.tolist())
            if not same or len(one_dump) != 1:  # both tables at one dump, every row of it
                torn.append(salt)

    reader = threading.Thread(target=read)
    reader.start()
    for s in range(1, 40):
        outbox.dump(g, s, {T_EMB: (keys, float(s)), T_ZCH: (keys, float(s))})
        replica.apply(outbox.root.read_manifest(RUN, g, s))
    done.set()
    reader.join()
    assert not torn and len(seen) > 1


def test_a_pinned_snapshot_keeps_its_rows_while_later_dumps_reuse_memory(outbox):
    g = outbox.generation()
    keys = np.arange(64)
    outbox.dump(g, 0, {T_EMB: (keys, 0.0)}, kind=DumpKind.SNAPSHOT)
    replica = Replica(outbox.root, RUN)
    replica.install(replica.load(g, 0))
    with replica.pinned() as old:
        for s in range(1, 6):
            outbox.dump(g, s, {T_EMB: (keys, float(s))})
            replica.apply(outbox.root.read_manifest(RUN, g, s))
        np.testing.assert_array_equal(
            old.table(T_EMB).read(keys)[2], outbox.expected_row(T_EMB, keys, 0.0)
        )
    np.testing.assert_array_equal(
        replica.read(T_EMB, keys)[2], outbox.expected_row(T_EMB, keys, 5.0)
    )


def test_restart_resumes_from_the_recorded_state_without_rereading_earlier_dumps(outbox, tmp_path):
    g = outbox.first_generation()
    state_dir = str(tmp_path / "state")
    f = _follower(outbox, g, 1, state_dir=state_dir)
    f.poll()
    f.stop()
    # The snapshot's shards are gone: a replica that re-read the lineage could not start.
    for shard in outbox.root.read_manifest(RUN, g, 0).shards:
        os.remove(os.path.join(outbox.root.dump_dir(RUN, g, 0), shard.path))
    outbox.dump(g, 2, {T_EMB: (np.array([2, 70]), 2.0)})
    again = _follower(outbox, g, 1, state_dir=state_dir)
    assert again.resume() and again.replica.current.position.seq == 1
    again.poll()
    found, versions, rows = again.replica.read(T_EMB, np.array([2, 40, 70]))
    assert found.all() and again.status().seq == 2
    assert versions.tolist() == [g << 32 | 2, g << 32 | 0, g << 32 | 2]
    np.testing.assert_array_equal(rows[1], outbox.expected_row(T_EMB, np.array([40]), 0.0)[0])


def test_restart_refuses_to_advance_when_the_outbox_holds_another_dump_than_the_one_applied(
    outbox, tmp_path
):
    g = outbox.first_generation()
    state_dir = str(tmp_path / "state")
    f = _follower(outbox, g, 1, state_dir=state_dir)
    f.poll()
    f.stop()
    outbox.dump(g, 1, {T_EMB: (np.array([3]), 9.0)})  # dump 1 rewritten with other rows
    outbox.dump(g, 2, {T_EMB: (np.array([4]), 2.0)})
    again = _follower(outbox, g, 1, state_dir=state_dir)
    again.resume()
    again.poll()
    assert again.status().seq == 1 and "duplicate" in again.status().blocked


def test_a_replica_without_a_promoted_generation_is_not_ready(outbox):
    outbox.first_generation()
    replica = Replica(outbox.root, RUN)
    f = Follower(replica, FixedPointer(None))
    f.poll()
    assert not f.status().ready
    with pytest.raises(NotReadyError):
        replica.read(T_EMB, np.array([0]))


def test_a_promoted_point_the_outbox_does_not_hold_is_reported_and_retried(outbox):
    g = outbox.first_generation()
    replica = Replica(outbox.root, RUN)
    f = Follower(
        replica, FixedPointer(ServingPointer(RUN, g + 1, 0, 1.0)), FollowOptions(poll_s=0.01)
    )
    f.start()
    try:
        deadline = time.monotonic() + 30
        while f.status().error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert f"generation {g + 1}" in f.status().error and not f.status().ready
        f.pointer_source.pointer = ServingPointer(RUN, g, 1, 2.0)  # promoted again, correctly
        while not f.status().ready and time.monotonic() < deadline:
            time.sleep(0.01)
        assert f.status().seq == 1
    finally:
        f.stop()


def test_a_point_whose_lineage_misses_a_dump_is_never_loaded(outbox):
    g = outbox.first_generation()
    outbox.dump(g, 2, {T_EMB: (np.array([1]), 2.0)})
    outbox.dump(g, 3, {T_EMB: (np.array([1]), 3.0)})
    missing = outbox.root.dump_dir(RUN, g, 2)
    os.rename(missing, missing + ".removed")
    f = _follower(outbox, g, 3)
    f.poll()
    assert not f.status().ready and "dump 2 is missing" in f.status().blocked
    os.rename(missing + ".removed", missing)
    f.poll()
    assert f.status().ready and f.status().seq == 3 and f.status().blocked is None
