"""When verify fails, the FAIL branch runs: a direct-mode run is rolled back to the last promoted
generation, a staged one loses only its staging views; the webhook gets the summary and the
run ends failed. The failure is a lost write, injected by the training program
(tests/orchestrate/lossy_team)."""

import pathlib

import numpy as np
import pytest

from deltarec.artifacts import codec
from deltarec.orchestrate import steps
from deltarec.orchestrate.params import parse_params
from deltarec.stores import open_store

from .conftest import run_pipeline_locally, train_in_process

TABLES = '{"m.t": {"dim": 4}}'


def params(tmp_path, **change):
    values = dict(
        run_name="lt", artifact_root=str(tmp_path / "art"),
        store_url=f"sqlite:///{tmp_path / 'store.db'}", steps=10, dump_every_steps=5,
        sample_size=0, ranks_per_node=1, entry_point="lossy_team:main", tables=TABLES,
    )  # fmt: skip
    values.update(change)
    return parse_params(**values)


def promoted_generation_one(tmp_path, lossy_team, monkeypatch):
    p = params(tmp_path)
    steps.provision(p)
    record = train_in_process(lossy_team, monkeypatch, p)
    assert steps.verify(p, record).passed
    assert steps.promote(p, record).pointer.generation == 1
    return p


def live_rows(store_url, keys):
    with open_store(store_url) as store:
        got = store.read("m.t", keys)
    return codec.decode(got.embedding, store_dtype(store_url), 4)


def store_dtype(store_url):
    with open_store(store_url) as store:
        return store.views()["m.t"].dtype


def test_kfp_run_with_a_lost_write_rolls_back_calls_the_webhook_and_fails(
    tmp_path, lossy_team, monkeypatch, webhook, capsys
):
    promoted_generation_one(tmp_path, lossy_team, monkeypatch)
    result, _ = run_pipeline_locally(
        tmp_path, capsys, "--run", "lt", "--artifacts", str(tmp_path / "art"),
        "--store", f"sqlite:///{tmp_path / 'store.db'}", "--steps", "10", "--sample", "0",
        "--ranks-per-node", "1", "--entry-point", "lossy_team:main", "--tables", TABLES,
        "--train-args", "--lose-key 3", "--webhook-url", webhook.url, expect=1,
    )  # fmt: skip
    assert result["verdict"] == "FAIL" and result["promoted"] is None
    assert result["generation"]["generation"] == 2 and "verify-failed" in result["failure"]
    assert "<html" in pathlib.Path(result["report"]).read_text(encoding="utf-8").lower()
    (summary,) = webhook.received
    assert summary["action"] == "rolled-back" and summary["rolled_back_to"] == 1
    assert summary["generation"] == 2 and "m.t" in summary["failure"]
    assert summary["metrics"]["passed"] == 0.0
    # serving is generation 1 again: the pointer, and every row's value
    store = f"sqlite:///{tmp_path / 'store.db'}"
    with open_store(store) as s:
        pointer = s.registry.get_serving("lt")
    assert (pointer.generation, pointer.seq) == (1, 1) and "rollback" in pointer.note
    keys = lossy_team.KEYS
    want = codec.decode(lossy_team.rows_of(1).embedding, store_dtype(store), 4)
    np.testing.assert_array_equal(live_rows(store, keys), want)


def test_staged_run_that_fails_verify_drops_its_staging_views_and_leaves_live_alone(
    tmp_path, lossy_team, monkeypatch, webhook
):
    promoted_generation_one(tmp_path, lossy_team, monkeypatch)
    p = params(tmp_path, publish_mode="staged", webhook_url=webhook.url)
    record = train_in_process(lossy_team, monkeypatch, p, "--lose-key", "7")
    with open_store(p.store_url) as s:
        assert set(s.views(staging_generation=2)) == {"m.t"}
    outcome = steps.verify(p, record)
    assert outcome.verdict == "FAIL" and "m.t" in outcome.failure
    action = steps.on_verify_failed(p, outcome)
    assert (action.action, action.dropped_views, action.webhook_status) == (
        "dropped-staging", 1, 204,
    )  # fmt: skip
    assert webhook.received == [action.summary]
    with open_store(p.store_url) as s:
        assert s.views(staging_generation=2) == {}
        assert s.registry.get_serving("lt").generation == 1
    want = codec.decode(lossy_team.rows_of(1).embedding, store_dtype(p.store_url), 4)
    np.testing.assert_array_equal(live_rows(p.store_url, lossy_team.KEYS), want)
    with pytest.raises(steps.VerifyFailedError, match="dropped-staging"):
        raise steps.VerifyFailedError(outcome, action)


def test_fail_branch_of_a_never_promoted_run_has_nothing_to_undo_and_survives_a_dead_webhook(
    tmp_path, lossy_team, monkeypatch
):
    p = params(tmp_path, webhook_url="http://127.0.0.1:1/unreachable")
    steps.provision(p)
    record = train_in_process(lossy_team, monkeypatch, p, "--lose-key", "0")
    outcome = steps.verify(p, record)
    action = steps.on_verify_failed(p, outcome)
    assert (action.action, action.rolled_back_to, action.webhook_status) == (
        "nothing-to-undo", None, 0,
    )  # fmt: skip


def test_kfp_run_of_a_run_that_does_not_serve_fails_and_leaves_serving_to_the_run_that_does(
    tmp_path, lossy_team, monkeypatch, webhook, capsys
):
    from deltarec.artifacts import ArtifactRoot
    from deltarec.artifacts.lineage import expected_state
    from deltarec.stores import who_serves

    promoted_generation_one(tmp_path, lossy_team, monkeypatch)  # lt serves
    other = params(tmp_path, run_name="other")
    record = train_in_process(lossy_team, monkeypatch, other)
    assert steps.verify(other, record).passed
    steps.promote(other, record)  # other takes serving over
    store = f"sqlite:///{tmp_path / 'store.db'}"
    run_pipeline_locally(
        tmp_path, capsys, "--run", "lt", "--artifacts", str(tmp_path / "art"),
        "--store", store, "--steps", "10", "--sample", "0",
        "--ranks-per-node", "1", "--entry-point", "lossy_team:main", "--tables", TABLES,
        "--train-args", "--lose-key 3", "--webhook-url", webhook.url, expect=1,
    )  # fmt: skip
    (summary,) = webhook.received
    assert (summary["action"], summary["rolled_back_to"]) == ("serving-unchanged", None)
    assert summary["serving_before"]["tables"] == {"m.t": "other"}
    assert summary["serving_after"] == summary["serving_before"]
    assert summary["message"].startswith("serving unchanged: run 'other' generation 1 dump")
    with open_store(store) as s:
        assert who_serves(s).runs == ["other"]
        assert "rollback" not in s.registry.get_serving("lt").note  # lt was not rolled back
        state = expected_state(ArtifactRoot(str(tmp_path / "art")), "other", 1)
        et = state.tables["m.t"]
        got = s.read("m.t", et.keys)  # what serving reads: other's rows, key by key
        assert np.array_equal(got.found, et.present)
        np.testing.assert_array_equal(got.embedding[et.present], et.load(et.present_keys()))
