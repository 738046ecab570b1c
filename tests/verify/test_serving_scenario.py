"""One store over a run's life: what serving reads equals, key by key, the generation that
should serve after every step (promote, retrain, a failed verify, rollback, take-over).

Generations are written with the artifacts API and published by the real publisher; the
failed verify goes through the pipelines' own FAIL step. Every backend that can list its keys.
A serving replica of run ``one`` follows the store beside it: while ``one`` serves it holds the
same point key by key and is ready; while ``two`` serves it is not ready.
"""

import numpy as np
from tests._helpers.artifacts import Lineage

from deltarec.artifacts.lineage import expected_state
from deltarec.ids import make_version
from deltarec.orchestrate import steps
from deltarec.orchestrate.params import parse_params
from deltarec.promote import promote, rollback
from deltarec.serving.follow import Follower, StorePointer
from deltarec.serving.replica import Replica
from deltarec.stores import open_store, who_serves
from deltarec.verify import VerifyOptions, verify, write_record


class Walk:
    """The runs of one store and one artifact root, and the checks after each step."""

    def __init__(self, tmp_path, url):
        root = Lineage.under(tmp_path).root
        self.url = url
        self.runs = {r: Lineage(root, run=r) for r in ("one", "two")}
        self.follower = Follower(Replica(root, "one"), StorePointer(url, root.uri, "one"))

    def handle(self, run=None):
        return open_store(self.url, self.runs["one"].root.uri, run=run)

    def generation(self, run, emb, zch, publish=True):
        """A fresh retrain of ``run`` (a snapshot of ``emb`` and ZCH ids ``zch``), published."""
        lineage = self.runs[run]
        g = lineage.first_generation(keys=emb, updated=emb[:5], zch_keys=zch)
        if publish:
            with self.handle(run) as store:
                lineage.publish(store, g)
        return g

    def verify(self, run, generation):
        lineage = self.runs[run]
        with self.handle(run) as store:
            result = verify(
                lineage.root, run, store, generation=generation,
                store_url=store.describe(), options=VerifyOptions(sample=None),
            )  # fmt: skip
        write_record(lineage.root, result)
        return result

    def promote(self, run, generation):
        assert self.verify(run, generation).passed
        with self.handle(run) as store:
            promote(self.runs[run].root, run, store, generation)

    def fail(self, run, generation):
        """The store loses a row of ``generation``; verify fails; the FAIL step runs."""
        with self.handle(run) as store:
            store.delete(Lineage.T_EMB, np.array([int(self.first_key(run, generation))]),
                         make_version(generation, 1))  # fmt: skip
        outcome = steps.outcome_of(self.verify(run, generation))
        assert outcome.verdict == steps.FAIL
        root = self.runs[run].root.uri
        return steps.on_verify_failed(
            parse_params(run_name=run, artifact_root=root, store_url=self.url), outcome
        )

    def assert_replica(self, run, state):
        follower = self.follower
        follower.poll()
        ready, why = follower.readiness()
        if run != "one":
            assert not ready and f"serving is run {run!r}" in why
            return
        assert ready, why
        with follower.replica.pinned() as snap:
            assert (snap.position.generation, snap.position.seq) == (
                state.generation, state.through_seq,
            )  # fmt: skip
            for table, et in state.tables.items():
                keys = et.present_keys()
                held = snap.table(table)
                np.testing.assert_array_equal(held.keys_np, keys)
                found, _, rows = held.read(keys)
                assert found.all()
                np.testing.assert_array_equal(rows, et.load(keys))

    def first_key(self, run, generation):
        state = expected_state(self.runs[run].root, run, generation)
        return state.tables[Lineage.T_EMB].present_keys()[0]

    def assert_serving(self, run, generation, seq=1):
        """What serving reads (a handle without a run) is ``run``'s point, key by key; the
        replica of run one holds it too (or is not ready while another run serves)."""
        lineage = self.runs[run]
        state = expected_state(lineage.root, run, generation, seq)
        self.assert_replica(run, state)
        with self.handle() as serving:
            assert who_serves(serving).runs == [run]
            for table, et in state.tables.items():
                got = serving.read(table, et.keys)
                assert np.array_equal(got.found, et.present), (run, generation, table)
                p = et.present
                assert np.array_equal(got.embedding[p], et.load(et.keys[p])), table
                held = np.concatenate([*serving.scan_keys(table), np.empty(0, np.int64)])
                assert np.array_equal(np.sort(held), et.present_keys()), (run, table)


def test_serving_equals_the_generation_that_should_serve_after_every_step(tmp_path, store_url):
    walk = Walk(tmp_path, store_url)
    one_1 = walk.generation("one", np.arange(0, 100), np.array([-1, 3, 7, 11, 19]))
    walk.promote("one", one_1)
    walk.assert_serving("one", one_1)

    one_2 = walk.generation("one", np.arange(40, 140), np.array([-1, 5, 11, 40]))  # retrain
    walk.promote("one", one_2)
    walk.assert_serving("one", one_2)

    one_3 = walk.generation("one", np.arange(90, 200), np.array([-1, 2, 50]))
    action = walk.fail("one", one_3)  # one serves: back to its last promoted point
    assert (action.action, action.rolled_back_to) == ("rolled-back", one_2)
    assert action.summary["rollback_check"] == "passed"
    walk.assert_serving("one", one_2)

    with walk.handle("one") as store:
        back = rollback(walk.runs["one"].root, "one", store, one_1)
    assert back.passed and back.came_back[Lineage.T_ZCH] == 2  # ids 3, 19 come back
    walk.assert_serving("one", one_1)

    two_1 = walk.generation("two", np.arange(500, 560), np.array([-1, 60, 61]))
    walk.assert_serving("one", one_1)  # two publishes into its own views
    walk.promote("two", two_1)  # take-over
    walk.assert_serving("two", two_1)

    one_5 = walk.generation("one", np.arange(0, 30), np.array([-1, 9]))
    action = walk.fail("one", one_5)  # one does not serve: nothing changes
    assert action.action == "serving-unchanged"
    assert action.message.startswith("serving unchanged: run 'two' generation 1 dump 1")
    walk.assert_serving("two", two_1)

    with walk.handle("one") as store:  # one takes serving back, at its generation 1
        again = rollback(walk.runs["one"].root, "one", store, one_1)
    assert again.serving_before.runs == ["two"] and again.serving_after.runs == ["one"]
    walk.assert_serving("one", one_1)
    walk.follower.pointer_source.close()
