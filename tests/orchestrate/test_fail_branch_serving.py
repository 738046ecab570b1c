"""The FAIL branch changes who serves only if the failing run serves (SPEC §7).

Regression: runs ``one``, ``two``, then ``one`` again were promoted (serving: ``one``); a run
of ``two`` failed verify and the FAIL branch rolled ``two`` back to its own last promoted
generation, which made ``two`` serve every table. Written with the artifacts API and the real
publisher (no training), on SQLite; the steps are the pipeline's own.
"""

import numpy as np
from tests._helpers.artifacts import Lineage, sqlite_url_in

from deltarec.artifacts.lineage import expected_state
from deltarec.ids import make_version
from deltarec.orchestrate import steps
from deltarec.orchestrate.params import parse_params
from deltarec.promote import promote, who_serves
from deltarec.stores import open_store
from deltarec.verify import VerifyOptions, verify, write_record


def _verify(lineage, store, generation):
    result = verify(
        lineage.root, lineage.run, store, generation=generation,
        store_url=store.describe(), options=VerifyOptions(sample=None),
    )  # fmt: skip
    write_record(lineage.root, result)
    return result


def _publish_and_promote(lineage, url, generation):
    with open_store(url, lineage.root.uri, run=lineage.run) as store:
        lineage.publish(store, generation)
        assert _verify(lineage, store, generation).passed
        promote(lineage.root, lineage.run, store, generation)


def _failed_generation(lineage, url):
    """A new generation of ``lineage``'s run whose key 5 the store lost: verify FAILs."""
    g = lineage.first_generation(keys=np.arange(200, 260), updated=np.arange(200, 205))
    with open_store(url, lineage.root.uri, run=lineage.run) as store:
        lineage.publish(store, g)
        store.delete(lineage.T_EMB, np.array([210]), make_version(g, 1))
        outcome = steps.outcome_of(_verify(lineage, store, g))
    assert outcome.verdict == steps.FAIL
    return outcome


def assert_serving_reads(url, lineage, generation, seq):
    """What serving reads (a handle without a run), key by key, is the point's expected state."""
    state = expected_state(lineage.root, lineage.run, generation, seq)
    with open_store(url) as serving:
        for table, et in state.tables.items():
            got = serving.read(table, et.keys)
            assert np.array_equal(got.found, et.present), table
            p = et.present
            assert np.array_equal(got.embedding[p], et.load(et.keys[p])), table


def test_a_failing_run_that_does_not_serve_leaves_serving_to_the_run_that_does(tmp_path, webhook):
    url = sqlite_url_in(tmp_path)
    one = Lineage(Lineage.under(tmp_path).root, run="one")
    two = Lineage(one.root, run="two")
    _publish_and_promote(one, url, one.first_generation())  # one serves
    _publish_and_promote(two, url, two.first_generation(keys=np.arange(100, 180)))  # two
    one_g2 = one.first_generation(keys=np.arange(0, 120))
    _publish_and_promote(one, url, one_g2)  # one takes serving back
    outcome = _failed_generation(two, url)

    params = parse_params(
        run_name="two", artifact_root=one.root.uri, store_url=url, webhook_url=webhook.url
    )
    action = steps.on_verify_failed(params, outcome)

    assert action.action == "serving-unchanged" and action.rolled_back_to is None
    assert action.message.startswith("serving unchanged: run 'one' generation 2 dump 1")
    (summary,) = webhook.received
    assert summary["serving_before"]["runs"] == {"one": {"generation": 2, "seq": 1}}
    assert summary["serving_after"] == summary["serving_before"]
    assert set(summary["serving_after"]["tables"].values()) == {"one"}
    with open_store(url, one.root.uri) as store:
        assert who_serves(store).runs == ["one"]
        assert store.registry.get_serving("two").generation == 1  # two's pointer untouched
    assert_serving_reads(url, one, one_g2, 1)


def test_a_failing_run_that_serves_is_rolled_back_and_the_webhook_says_who_served(
    tmp_path, webhook
):
    url = sqlite_url_in(tmp_path)
    one = Lineage(Lineage.under(tmp_path).root, run="one")
    g1 = one.first_generation()
    _publish_and_promote(one, url, g1)
    outcome = _failed_generation(one, url)  # a fresh retrain of one, published directly
    params = parse_params(
        run_name="one", artifact_root=one.root.uri, store_url=url, webhook_url=webhook.url
    )
    action = steps.on_verify_failed(params, outcome)

    assert (action.action, action.rolled_back_to) == ("rolled-back", g1)
    (summary,) = webhook.received
    assert summary["rollback_check"] == "passed"
    assert summary["serving_before"]["runs"] == {"one": {"generation": 1, "seq": 1}}
    assert "serving before: run 'one' generation 1 dump 1" in action.message
    assert_serving_reads(url, one, g1, 1)  # every key of generation 1 back, 200.. gone
