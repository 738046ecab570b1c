"""The Airflow DAG: its file parses in a DagBag over the pipeline's images and steps, the core
never imports Airflow, and a local ``dag.test()`` run (SQLite) of a generation that lost a
write rolls serving back to the generation promoted before, calls the webhook and fails."""

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

from deltarec.artifacts import ArtifactRoot, codec
from deltarec.artifacts.base import list_bases, read_base
from deltarec.cli import main
from deltarec.orchestrate.images import TOOLS_IMAGE, TRAINER_IMAGE
from deltarec.orchestrate.params import PipelineParams
from deltarec.stores import open_store

from .conftest import check_dag_folder

# Airflow is imported only in child processes with a scratch AIRFLOW_HOME: importing it here
# would configure Airflow (and its logging) for the whole test session from ~/airflow.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("airflow") is None, reason="the airflow extra is not installed"
)

STEPS = {"params", "provision", "train_route", "train", "train_launcher", "compact_plan",
         "compact_items", "compact_partition", "compact", "verify_plan", "verify_partition",
         "verify", "branch", "promote", "gc", "verify_failed"}  # fmt: skip


def test_compiled_dag_file_parses_in_a_dagbag_with_pods_on_the_pipeline_images(tmp_path):
    dags = tmp_path / "dags"
    assert main(["pipeline", "compile", "--engine", "airflow", "--output",
                 str(dags / "deltarec_dag.py"), "--secret", "pg-cred:password=PGPASSWORD",
                 "--secret", "cloud"]) == 0  # fmt: skip
    (dags / "broken_dag.py").write_text("from airflow.sdk import DAG\nimport no_such_module\n")
    found = check_dag_folder(dags, tmp_path)
    assert list(found["import_errors"]) == [str(dags / "broken_dag.py")]  # the check can fail
    assert found["dags"] == ["deltarec"] and found["params"] == sorted(PipelineParams.names())
    tasks = found["tasks"]
    assert set(tasks) == STEPS
    pods = {t: v for t, v in tasks.items() if v["operator"] == "KubernetesPodOperator"}
    assert set(pods) == STEPS - {
        "params", "branch", "train_route", "verify_plan", "verify_partition", "compact_items",
        "compact_partition",
    }  # fmt: skip
    # one node: the train pod on the trainer image with gpus_per_node GPUs; several: its own
    # launcher pod on the tools image, with no GPU, picked by train_route
    assert pods["train"]["image"] == TRAINER_IMAGE and "gpus_per_node" in pods["train"]["gpus"]
    assert pods["train_launcher"]["gpus"] is None
    assert {pods[t]["image"] for t in pods if t != "train"} == {TOOLS_IMAGE}
    assert tasks["train_route"]["operator"] == "_BranchPythonDecoratedOperator"
    assert tasks["train_route"]["upstream"] == ["params", "provision"]
    assert tasks["train"]["upstream"] == tasks["train_launcher"]["upstream"] == ["train_route"]
    assert pods["train_launcher"]["arguments"][0] == "train"
    assert pods["train_launcher"]["arguments"][-4:] == pods["train"]["arguments"][-4:]
    mapped = tasks["verify_partition"]
    assert mapped["operator"] == "MappedOperator" and mapped["upstream"] == ["verify_plan"]
    assert tasks["verify"]["upstream"] == ["verify_partition"]
    assert pods["verify"]["arguments"][0] == "verify_gate"
    assert all(p["cmds"] == ["python", "-m", "deltarec.orchestrate.airflow_task"]
               for p in pods.values())  # fmt: skip
    for p in pods.values():  # key by key, as the KFP pipeline mounts them; names only
        assert p["env"][0] == ["PGPASSWORD", "pg-cred", "password"]
        assert ["AWS_SECRET_ACCESS_KEY", "cloud", "AWS_SECRET_ACCESS_KEY"] in p["env"]
    assert pods["train"]["arguments"][-2:] == ["--secrets", "pg-cred,cloud"]
    verify = pods["verify"]["arguments"]
    assert verify[:2] == ["verify_gate", "--params"]
    assert "xcom_pull(task_ids='verify_partition')" in verify[verify.index("--partitions") + 1]
    record = verify[verify.index("--input") + 1]
    assert "xcom_pull(task_ids='train')" in record and "task_ids='train_launcher'" in record
    assert "{{ run_id }}" in pods["train"]["arguments"]
    assert tasks["branch"]["upstream"] == ["verify"]
    # compaction between train and verify: a plan pod, a mapped pod a partition, one commit
    assert tasks["compact_plan"]["upstream"] == ["train", "train_launcher"]
    assert tasks["compact_plan"]["trigger_rule"] == "none_failed_min_one_success"  # one skipped
    assert "task_ids='train_launcher'" in " ".join(pods["compact_plan"]["arguments"])
    cmapped = tasks["compact_partition"]
    assert cmapped["operator"] == "MappedOperator" and cmapped["upstream"] == ["compact_items"]
    assert tasks["compact"]["upstream"] == ["compact_partition", "compact_plan"]
    assert tasks["compact"]["trigger_rule"] == "none_failed"  # no partition: mapped is skipped
    assert "xcom_pull(task_ids='compact_plan')" in " ".join(pods["compact"]["arguments"])
    assert tasks["verify_plan"]["upstream"] == ["compact", "params"]
    assert tasks["verify_plan"]["trigger_rule"] == "none_failed_min_one_success"
    assert tasks["gc"]["upstream"] == ["promote"] and pods["gc"]["arguments"][0] == "gc"
    assert tasks["promote"]["upstream"] == tasks["verify_failed"]["upstream"] == ["branch"]
    assert tasks["provision"]["upstream"] == ["params"]


def test_the_core_and_the_kfp_side_never_import_airflow():
    code = (
        "import sys, deltarec.orchestrate, deltarec.orchestrate.steps, deltarec.orchestrate.local,"
        " deltarec.orchestrate.pipeline, deltarec.orchestrate.airflow_task, deltarec.cli,"
        " deltarec.orchestrate.airflow_local,"
        " deltarec.cli.cmd_pipeline, deltarec.cli.cmd_demo, deltarec.demo\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'airflow')\n"
        "assert not bad, bad\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def test_airflow_local_run_of_a_run_that_does_not_serve_fails_and_leaves_serving_as_it_was(
    tmp_path, lossy_team, monkeypatch, webhook, capsys
):
    """Runs lt, then other, are promoted (other serves); a DAG run of lt loses a write: it
    fails, calls the webhook, and who serves does not change (the FAIL branch that rolls a
    serving run back runs under the real scheduler: test_airflow_scheduler.py)."""
    from deltarec.orchestrate import airflow_task

    from .conftest import train_in_process

    store = f"sqlite:///{tmp_path / 'store.db'}"
    common = [
        "--run", "lt", "--artifacts", str(tmp_path / "art"), "--store", store, "--steps", "10",
        "--sample", "0", "--ranks-per-node", "1", "--entry-point", "lossy_team:main",
        "--tables", '{"m.t": {"dim": 4}}', "--webhook-url", webhook.url,
        "--compact-min-dumps", "1", "--compact-partition-rows", "5",
    ]  # fmt: skip
    # generation 1 through the DAG's own task functions (in this process): promoted
    conf = dict(
        run_name="lt", artifact_root=str(tmp_path / "art"), store_url=store, steps=10,
        dump_every_steps=100, sample_size=0, ranks_per_node=1, entry_point="lossy_team:main",
    )  # fmt: skip
    params = PipelineParams(**conf)
    airflow_task.provision(airflow_task.check_params(conf))
    record = train_in_process(lossy_team, monkeypatch, params).to_metadata()
    outcome = airflow_task.verify(conf, record)
    assert airflow_task.choose(outcome) == "promote" and outcome["report_path"].endswith(
        "lt/gen-000001/verify-report-000001.html"
    )
    assert airflow_task.promote(conf, record) == 1
    other = {**conf, "run_name": "other"}  # another run takes serving over
    airflow_task.provision(airflow_task.check_params(other))
    taken = train_in_process(lossy_team, monkeypatch, PipelineParams(**other)).to_metadata()
    assert airflow_task.choose(airflow_task.verify(other, taken)) == "promote"
    assert airflow_task.promote(other, taken) == 1

    # generation 2 of lt loses a write: the DAG run fails and calls the webhook; serving stays
    out = tmp_path / "result.json"
    code = main(["pipeline", "run", "--local", "--engine", "airflow", *common,
                 "--train-args", "--lose-key 3", "--pipeline-root", str(tmp_path / "airflow"),
                 "--json", str(out)])  # fmt: skip
    assert code == 1, capsys.readouterr().out[-3000:]
    failed = json.loads(out.read_text())
    assert failed["verdict"] == "FAIL" and failed["promoted"] is None
    assert failed["generation"]["generation"] == 2 and "verify_failed" in failed["failure"]
    assert failed["metrics"]["keys_checked"] == 20.0 and failed["metrics"]["passed"] == 0.0
    assert failed["report"].endswith("lt/gen-000002/verify-report-000001.html")
    # compacted before verify by 4 mapped partitions of 5 keys; verify read from that base
    root = ArtifactRoot(str(tmp_path / "art"))
    assert list_bases(root, "lt") == [(2, 1)] and read_base(root, "lt", 2, 1).rows == {"m.t": 20}
    assert len(read_base(root, "lt", 2, 1).parts) == 1
    assert capsys.readouterr().out.count("Executing task 'compact_partition'") == 4
    (summary,) = webhook.received
    assert (summary["action"], summary["rolled_back_to"]) == ("serving-unchanged", None)
    assert summary["serving_before"]["tables"] == {"m.t": "other"}
    assert summary["serving_after"] == summary["serving_before"]
    with open_store(store) as s:
        assert s.registry.serving_runs() == {"m.t": "other"}
        assert "rollback" not in s.registry.get_serving("lt").note
        dtype = s.views()["m.t"].dtype
        got = s.read("m.t", lossy_team.KEYS)  # what serving reads: other's generation 1
    want = codec.decode(lossy_team.rows_of(1).embedding, dtype, 4)
    np.testing.assert_array_equal(codec.decode(got.embedding, dtype, 4), want)


def test_the_airflow_engine_without_airflow_installed_names_the_extra(tmp_path, monkeypatch):
    import importlib.util

    from deltarec.errors import ConfigError
    from deltarec.orchestrate import airflow_local

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "airflow" else real(name, *a)
    )
    conf = PipelineParams(run_name="r", artifact_root=str(tmp_path), store_url="sqlite:///x.db")
    with pytest.raises(ConfigError, match=r"deltarec\[airflow\]"):
        airflow_local.run_airflow_local(conf, workdir=str(tmp_path / "w"))
