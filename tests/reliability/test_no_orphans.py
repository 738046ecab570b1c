"""No orphans: a rank ends with its launcher, and a PyTorchJob with the step that created it.

The end-to-end check (``kill -9`` of ``deltarec train --nproc-per-node 2``'s process group,
its ranks gone within seconds) runs at every kill of the fault campaign
(``test_fault_campaign.py``, ``Trainer.kill_tree``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from tests._helpers.campaign import alive

from deltarec.orchestrate import pytorchjob as pj
from deltarec.orchestrate.types import TrainJobFailedError


def test_a_process_that_calls_exit_with_parent_ends_within_a_second_of_its_parent(tmp_path):
    # parent (own session) -> child in a session of its own, like torchrun's ranks
    ready = tmp_path / "child-ready"
    child_code = textwrap.dedent(
        f"""
        import pathlib, time
        from deltarec.train.launch import exit_with_parent
        exit_with_parent()
        pathlib.Path({str(ready)!r}).write_text("ready")
        time.sleep(120)
        """
    )
    parent_code = textwrap.dedent(
        f"""
        import subprocess, sys, time
        p = subprocess.Popen([sys.executable, "-c", {child_code!r}], start_new_session=True)
        print(p.pid, flush=True)
        time.sleep(120)
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], stdout=subprocess.PIPE, start_new_session=True
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    # wait until the child has set its parent-death signal (it writes `ready` right after)
    deadline = time.monotonic() + 60.0
    while not ready.exists() and alive(child) and time.monotonic() < deadline:
        time.sleep(0.02)
    if not ready.exists():
        os.killpg(parent.pid, signal.SIGKILL)
        if alive(child):
            os.kill(child, signal.SIGKILL)
        pytest.fail("the child did not report its parent-death signal set within 60 s")
    assert alive(child)
    os.killpg(parent.pid, signal.SIGKILL)  # the child is in another session: not reached
    parent.wait()
    deadline = time.monotonic() + 3.0
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.02)
    gone = not alive(child)
    if not gone:
        os.kill(child, signal.SIGKILL)
    assert gone, "the child outlived its parent by 3 s"


class ApiException(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


class FakeCustomObjectsApi:
    """The three calls of CustomObjectsApi, strict about group/version/plural."""

    def __init__(self, state: str = "Running") -> None:
        self.objects: dict[tuple[str, str], dict] = {}
        self.state = state
        self.deleted: list[tuple[str, str, str]] = []

    def _check(self, group: str, version: str, plural: str) -> None:
        assert (group, version, plural) == ("kubeflow.org", "v1", "pytorchjobs")

    def create_namespaced_custom_object(self, group, version, namespace, plural, body):
        self._check(group, version, plural)
        key = (namespace, body["metadata"]["name"])
        if key in self.objects:
            raise ApiException(409)
        self.objects[key] = body
        return body

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        self._check(group, version, plural)
        if (namespace, name) not in self.objects:
            raise ApiException(404)
        obj = dict(self.objects[(namespace, name)])
        obj["status"] = {"conditions": [{"type": self.state, "status": "True"}]}
        return obj

    def delete_namespaced_custom_object(
        self, group, version, namespace, plural, name, *, propagation_policy="Background"
    ):
        self._check(group, version, plural)
        if self.objects.pop((namespace, name), None) is None:
            raise ApiException(404)
        self.deleted.append((namespace, name, propagation_policy))
        return {}


def _spec(timeout_s: int = 600) -> pj.TrainJobSpec:
    return pj.TrainJobSpec(
        name="deltarec-ctr-abc", namespace="ml", image="trainer:1", nodes=2, procs_per_node=2,
        gpus_per_node=0, train_args=("--run", "ctr"), timeout_s=timeout_s,
    )  # fmt: skip


def test_the_job_is_owned_by_the_step_pod_named_in_its_environment(monkeypatch):
    monkeypatch.setenv(pj.POD_NAME_ENV, "pipeline-train-x7k2p")
    monkeypatch.setenv(pj.POD_UID_ENV, "0b9d6d1e-52a8-4c4e-9b53-8d1d1f0c1a11")
    api = FakeCustomObjectsApi(state="Succeeded")
    pj.run_train_job(_spec(), api, sleep=lambda s: None)
    (job,) = api.objects.values()
    assert job["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": "pipeline-train-x7k2p",
            "uid": "0b9d6d1e-52a8-4c4e-9b53-8d1d1f0c1a11",
            "controller": False,
            "blockOwnerDeletion": False,
        }
    ]
    assert api.deleted == []  # a finished job is kept


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_step_stopped_by_a_signal_deletes_its_running_job(monkeypatch, sig):
    monkeypatch.delenv(pj.POD_NAME_ENV, raising=False)
    api = FakeCustomObjectsApi(state="Running")
    before = signal.getsignal(sig)

    def sleep(seconds: float) -> None:  # the pod is deleted while the step polls
        os.kill(os.getpid(), sig)
        time.sleep(0.1)

    with pytest.raises(pj.StepStopped, match=signal.Signals(sig).name):
        pj.run_train_job(_spec(), api, sleep=sleep)
    assert api.deleted == [("ml", "deltarec-ctr-abc", "Foreground")]
    assert signal.getsignal(sig) == before  # the step's own handlers are restored


def test_a_step_that_fails_while_following_its_job_deletes_it():
    api = FakeCustomObjectsApi(state="Running")
    polls = [0]
    real_get = api.get_namespaced_custom_object

    def get(*args):
        polls[0] += 1
        if polls[0] == 2:  # the API server answers 500 once while the step follows the job
            raise ApiException(500)
        return real_get(*args)

    api.get_namespaced_custom_object = get  # type: ignore[method-assign]
    with pytest.raises(ApiException):
        pj.run_train_job(_spec(), api, sleep=lambda s: None)
    assert api.deleted == [("ml", "deltarec-ctr-abc", "Foreground")]


def test_a_failed_job_is_kept_for_its_record():
    api = FakeCustomObjectsApi(state="Failed")
    with pytest.raises(TrainJobFailedError, match="failed"):
        pj.run_train_job(_spec(), api, sleep=lambda s: None)
    assert api.deleted == [] and len(api.objects) == 1


def test_the_compiled_pipeline_gives_the_job_launcher_its_pod_name_and_uid(tmp_path):
    pytest.importorskip("kfp")
    import yaml

    from deltarec.orchestrate.pipeline import compile_pipeline

    text = Path(compile_pipeline(str(tmp_path / "p.yaml"))).read_text()
    docs = list(yaml.safe_load_all(text))
    executors = next(d for d in docs if "platforms" in d)["platforms"]["kubernetes"]
    train = executors["deploymentSpec"]["executors"]["exec-train-launcher"]
    assert {(f["name"], f["fieldPath"]) for f in train["fieldPathAsEnv"]} == {
        (pj.POD_NAME_ENV, "metadata.name"),
        (pj.POD_UID_ENV, "metadata.uid"),
    }


def test_the_airflow_local_child_ends_with_the_command_that_started_it(tmp_path):
    # `pipeline run --local --engine airflow` -> `python -m deltarec.orchestrate.airflow_local`
    pytest.importorskip("airflow", reason="the airflow extra is not installed")
    from deltarec.orchestrate.airflow_local import airflow_env

    work = tmp_path / "airflow"
    child_cmd = [sys.executable, "-m", "deltarec.orchestrate.airflow_local", "--workdir",
                 str(work), "--conf", "{}", "--result", str(tmp_path / "result.json")]  # fmt: skip
    parent_code = textwrap.dedent(
        f"""
        import subprocess, time
        p = subprocess.Popen({child_cmd!r}, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(p.pid, flush=True)
        time.sleep(120)
        """
    )
    env = {**os.environ, **airflow_env(str(work))}
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], stdout=subprocess.PIPE, env=env,
        start_new_session=True,
    )  # fmt: skip
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        # it makes Airflow's home after the parent-death signal is set and airflow imported
        home = env["AIRFLOW_HOME"]
        deadline = time.monotonic() + 120.0
        while alive(child) and not os.path.isdir(home) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert alive(child), "the child ended before its parent was killed"
        os.killpg(parent.pid, signal.SIGKILL)  # the child is in another session: not reached
        parent.wait()
        deadline = time.monotonic() + 3.0
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not alive(child), "the Airflow child outlived its parent by 3 s"
    finally:
        for pid in (parent.pid, child):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
