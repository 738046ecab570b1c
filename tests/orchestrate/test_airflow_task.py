"""The Airflow pods' entry point (``python -m deltarec.orchestrate.airflow_task STEP``): the
parameters and the upstream XCom in as JSON, the step's result out as the XCom file."""

import json

import pytest

from deltarec.errors import BadInputError
from deltarec.orchestrate import airflow_task, steps
from deltarec.orchestrate.params import PipelineParams

from .conftest import write_generation


def conf(tmp_path, **change):
    values = {
        "run_name": "r", "artifact_root": str(tmp_path / "art"),
        "store_url": f"sqlite:///{tmp_path / 's.db'}", "steps": "10",
        "dump_every_steps": "5.0", "tables": '{"m.t": {"dim": 4}}',
    }  # fmt: skip
    values.update(change)
    return values


def test_pod_entry_runs_provision_and_leaves_its_result_as_the_xcom_file(tmp_path):
    xcom = tmp_path / "airflow" / "xcom" / "return.json"
    argv = ["provision", "--params", json.dumps(conf(tmp_path)), "--xcom", str(xcom)]
    assert airflow_task.main(argv) == 0
    result = json.loads(xcom.read_text())
    assert result["views"] == {"m.t": "emb_r__m_t"} and result["generation"] is None


def test_pod_entry_fails_the_verify_failed_task_after_the_fail_branch(tmp_path):
    outcome = steps.VerifyOutcome("FAIL", "r", 1, 1, {"passed": 0.0}, "m.t: 1 MISSING", None)
    steps.provision(PipelineParams.from_arguments(conf(tmp_path)))
    argv = [
        "verify_failed", "--params", json.dumps(conf(tmp_path)),
        "--input", json.dumps(outcome.to_json()), "--xcom", str(tmp_path / "x.json"),
    ]  # fmt: skip
    with pytest.raises(steps.VerifyFailedError, match="nothing-to-undo"):
        airflow_task.main(argv)
    assert not (tmp_path / "x.json").exists()


def test_branch_follows_the_verdict_and_bad_xcom_is_named(tmp_path):
    write_generation(tmp_path / "art", "r", [(10, {"m.t": 2})])
    passed = steps.VerifyOutcome("PASS", "r", 1, 1, {"passed": 1.0})
    assert airflow_task.choose(passed.to_json()) == "promote"
    assert airflow_task.choose({**passed.to_json(), "verdict": "FAIL"}) == "verify_failed"
    with pytest.raises(BadInputError, match="not a verify outcome"):
        airflow_task.choose({"verdict": "PASS"})
    with pytest.raises(BadInputError, match="train task's XCom"):
        airflow_task.promote(conf(tmp_path), {"run": "r"})


def test_pod_entries_plan_fan_out_commit_and_collect_a_runs_history(tmp_path):
    """compact_plan -> compact_partition (each item) -> compact -> gc, as the pods run them."""
    from deltarec.artifacts import ArtifactRoot
    from deltarec.artifacts.base import list_bases

    write_generation(tmp_path / "art", "r", [(5, {"m.t": 30}), (10, {"m.t": 30})])
    root = ArtifactRoot(str(tmp_path / "art"))
    record = steps.generation_record(root, "r", 1).to_metadata()
    c = json.dumps(conf(tmp_path, compact_min_dumps="2", compact_partition_rows="25"))
    steps.provision(PipelineParams.from_arguments(json.loads(c)))

    def pod(step, *argv):
        xcom = tmp_path / f"{step}.json"
        assert airflow_task.main([step, "--params", c, *argv, "--xcom", str(xcom)]) == 0
        return json.loads(xcom.read_text())

    plan = pod("compact_plan", "--input", json.dumps(record))
    assert plan["decision"] == "fan-out" and [i["key_range"] for i in plan["items"]] == [
        "0/3",
        "1/3",
        "2/3",
    ]  # fmt: skip  (60 rows over 25 a task)
    for item in plan["items"]:
        assert pod("compact_partition", "--item", json.dumps(item))["tables"] == {"m.t": "written"}
    base = pod("compact", "--input", json.dumps(plan))
    assert base["written"] and base["rows"] == 60 and list_bases(root, "r") == [(1, 2)]
    done = pod("gc")
    assert done["mode"] == "delete" and done["deleted"] == 1 and "paths" not in done
    assert root.committed_seqs("r", 1) == [2]
