"""The DAG under a real Airflow 3 scheduler (LocalExecutor, SQLite metadata database on
127.0.0.1): runs triggered through the REST API and polled to their end. A PASS run promotes;
a FAIL run (a lost write) takes the rollback branch back to the promoted generation."""

import importlib.util
import os

import pytest

from deltarec.orchestrate.airflow_dag import DAG_ID, DEFAULT_DAG_FILE, write_dag_file
from deltarec.stores import open_store

from .airflow_server import AirflowServer
from .conftest import LOSSY_TEAM, assert_rolled_back_to_first

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("airflow") is None, reason="no airflow extra"),
]


@pytest.fixture
def airflow(tmp_path, webhook):
    write_dag_file(str(tmp_path / "af" / "dags" / DEFAULT_DAG_FILE), (), mode="local")
    path = os.pathsep.join([str(LOSSY_TEAM), os.environ.get("PYTHONPATH", "")])
    server = AirflowServer(tmp_path / "af", {"PYTHONPATH": path})
    try:
        server.start()
        server.wait_for_dag(DAG_ID)
        yield server
    finally:
        server.stop()  # Airflow first, then its database (tmp_path) goes


def test_a_real_scheduler_runs_a_pass_then_a_failing_run_that_rolls_back(
    tmp_path, airflow, webhook
):
    store = f"sqlite:///{tmp_path / 'store.db'}"
    conf = dict(
        run_name="lt", artifact_root=str(tmp_path / "art"), store_url=store, steps=10,
        dump_every_steps=100, sample_size=0, ranks_per_node=1, entry_point="lossy_team:main",
        tables='{"m.t": {"dim": 4}}', webhook_url=webhook.url, verify_partitions=2,
    )  # fmt: skip
    passed = airflow.wait_for_run(DAG_ID, airflow.trigger(DAG_ID, conf))
    assert passed["state"] == "success", (passed["tasks"], airflow.tail())
    assert passed["tasks"]["verify_partition"] == ["success", "success"]  # mapped over 2
    assert passed["tasks"]["promote"] == ["success"]
    assert passed["tasks"]["verify_failed"] == ["skipped"]
    with open_store(store) as s:
        assert s.registry.get_serving("lt").generation == 1

    failing = {**conf, "train_extra_args": "--lose-key 3"}
    failed = airflow.wait_for_run(DAG_ID, airflow.trigger(DAG_ID, failing))
    assert failed["state"] == "failed"
    assert failed["tasks"]["verify"] == ["success"] and failed["tasks"]["promote"] == ["skipped"]
    assert failed["tasks"]["verify_failed"] == ["failed"]
    assert_rolled_back_to_first(webhook, store)
