"""The Kubeflow Trainer v2 TrainJob path at the Kubernetes API boundary, with the official typed
models (kubeflow-trainer-api) and kubernetes client objects; no cluster."""

import os
import signal

import pytest
from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob
from kubernetes.client import (
    V1ContainerState,
    V1ContainerStateTerminated,
    V1ContainerStatus,
    V1ObjectMeta,
    V1Pod,
    V1PodList,
    V1PodStatus,
)

from deltarec.orchestrate import pytorchjob, steps
from deltarec.orchestrate import trainjob as tj
from deltarec.orchestrate.params import parse_params
from deltarec.orchestrate.types import CREDENTIAL_ENV, TrainJobFailedError

from .conftest import write_generation
from .test_pytorchjob import ApiException, FakeCustomObjectsApi


class FakeTrainerApi(FakeCustomObjectsApi):
    """A strict CustomObjectsApi for trainjobs: stores objects, scripts the statuses read."""

    resource = ("trainer.kubeflow.org", "v1alpha1", "trainjobs")

    def __init__(self, statuses=(), on_get=None):
        super().__init__(statuses)
        self.deleted = []
        self.on_get = on_get

    def check(self, body):
        TrainerV1alpha1TrainJob.from_dict(body)  # what the API server gets is a valid TrainJob

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        if (namespace, name) not in self.objects:
            raise ApiException(404)
        if self.on_get:
            self.on_get()
        return super().get_namespaced_custom_object(group, version, namespace, plural, name)

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name, **kw):
        if self.objects.pop((namespace, name), None) is None:
            raise ApiException(404)
        self.deleted.append((name, kw.get("propagation_policy")))


class FakeCoreApi:
    def __init__(self, pods=()):
        self.pods = list(pods)
        self.selectors = []

    def list_namespaced_pod(self, namespace, label_selector=""):
        self.selectors.append(label_selector)
        return V1PodList(items=self.pods)


def cond(kind, reason="", message="", status="True"):
    return {"type": kind, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": "2026-12-03T10:00:00Z"}  # fmt: skip


RUNNING = {
    "conditions": [cond("Created")],
    "jobsStatus": [
        {"name": "node", "active": 2, "failed": 0, "ready": 2, "succeeded": 0, "suspended": 0}
    ],
}
COMPLETE = {"conditions": [cond("Created"), cond("Complete", "JobsCompleted", "done")]}
FAILED = {"conditions": [cond("Failed", "JobFailed", "jobset failed: job node failed")]}


def spec(**kw):
    base = dict(
        name="deltarec-ctr-abc", namespace="ml", image="ghcr.io/deltarec/deltarec-trainer:0.1.0",
        nodes=3, procs_per_node=8, gpus_per_node=8,
        train_args=("--artifacts", "s3://b/a", "--run", "ctr", "--steps", "100"),
        secrets=("deltarec-credentials",), service_account="deltarec-pipeline", timeout_s=600,
        env=(("DELTAREC_METRICS_PORT", "9400"),),
    )  # fmt: skip
    base.update(kw)
    return pytorchjob.TrainJobSpec(**base)


def failed_pod(index, reason="Error", code=3, message="RuntimeError: rank 9 ran out of data"):
    term = V1ContainerStateTerminated(exit_code=code, reason=reason, message=message)
    return V1Pod(
        metadata=V1ObjectMeta(
            name=f"deltarec-ctr-abc-node-0-{index}",
            labels={"batch.kubernetes.io/job-completion-index": str(index)},
        ),
        status=V1PodStatus(
            phase="Failed",
            container_statuses=[
                V1ContainerStatus(
                    name="node",
                    image="i",
                    image_id="",
                    ready=False,
                    restart_count=0,
                    state=V1ContainerState(terminated=term),
                )
            ],
        ),
    )


def test_the_trainjob_refers_to_the_runtime_with_nodes_processes_gpus_env_and_secrets():
    owner = pytorchjob.OwnerPod("train-pod", "uid-1")
    job = tj.build_train_job(spec(), tj.TrainJobSettings(memory_per_node="64Gi"), owner)
    doc = job.to_dict()
    assert TrainerV1alpha1TrainJob.from_dict(doc).to_dict() == doc
    assert doc["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and doc["kind"] == "TrainJob"
    assert doc["metadata"]["name"] == "deltarec-ctr-abc" and doc["metadata"]["namespace"] == "ml"
    assert doc["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    s = doc["spec"]
    assert s["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "ClusterTrainingRuntime",
        "name": "torch-distributed",
    }
    assert s["activeDeadlineSeconds"] == 600
    t = s["trainer"]
    assert (t["numNodes"], t["numProcPerNode"]) == (3, 8)
    assert t["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": "8", "memory": "64Gi"}
    assert t["command"] == ["torchrun", "--no-python", "--", "deltarec", "train"]
    assert t["args"][:2] == ["--device", "cuda"] and "s3://b/a" in t["args"]
    env = {e["name"]: e for e in t["env"]}
    assert env["DELTAREC_METRICS_PORT"]["value"] == "9400"
    assert env["PGPASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "deltarec-credentials",
        "key": "PGPASSWORD",
        "optional": True,
    }
    assert {n for n, e in env.items() if "valueFrom" in e} == set(CREDENTIAL_ENV)
    (patch,) = s["runtimePatches"]
    pod = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    pod_spec = pod["template"]["spec"]["template"]["spec"]
    assert pod_spec["serviceAccountName"] == "deltarec-pipeline"
    assert pod_spec["securityContext"]["runAsNonRoot"] is True
    (node,) = pod_spec["containers"]
    assert node["name"] == "node" and node["securityContext"]["readOnlyRootFilesystem"] is True
    assert node["securityContext"]["allowPrivilegeEscalation"] is False
    assert {v["name"] for v in pod_spec["volumes"]} == {m["name"] for m in node["volumeMounts"]}


def test_a_cpu_trainjob_requests_no_gpu_and_trains_with_gloo():
    doc = tj.build_train_job(spec(gpus_per_node=0, secrets=(), service_account=None)).to_dict()
    t = doc["spec"]["trainer"]
    assert "resourcesPerNode" not in t and t["args"][:2] == ["--device", "cpu"]
    assert "ownerReferences" not in doc["metadata"]
    (patch,) = doc["spec"]["runtimePatches"]  # the hardening, without a service account
    pod = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    assert "serviceAccountName" not in pod["template"]["spec"]["template"]["spec"]


def test_a_retried_step_follows_the_trainjob_of_the_same_name_and_refuses_a_failed_one():
    api = FakeTrainerApi([RUNNING])
    job = tj.build_train_job(spec())
    tj.create_or_follow(api, job)
    again = tj.create_or_follow(api, job)
    assert len(api.created) == 1 and again["status"] == RUNNING
    api.statuses = [FAILED]
    with pytest.raises(TrainJobFailedError, match=r"TrainJob ml/deltarec-ctr-abc: exists .* "
                       r"failed: JobFailed jobset failed"):  # fmt: skip
        tj.create_or_follow(api, job)


def test_status_maps_to_the_step_outcome_with_the_failing_nodes_reason():
    assert tj.job_state({"status": RUNNING}) == ("Running", "")
    assert tj.job_state({"status": COMPLETE}) == ("Complete", "JobsCompleted done")
    assert tj.job_state({}) == ("Created", "")
    api = FakeTrainerApi([RUNNING, RUNNING, COMPLETE])
    tj.create_or_follow(api, tj.build_train_job(spec()))
    done = tj.TRAINJOB.wait(api, "ml", "deltarec-ctr-abc", timeout_s=100, poll_s=1,
                            sleep=lambda s: None)  # fmt: skip
    assert done["status"] == COMPLETE
    api = FakeTrainerApi([RUNNING, FAILED])
    core = FakeCoreApi([failed_pod(2)])
    with pytest.raises(TrainJobFailedError) as e:
        tj.run_train_job(spec(), api=api, core=core, poll_s=1, sleep=lambda s: None)
    assert str(e.value) == (
        "TrainJob ml/deltarec-ctr-abc: failed: JobFailed jobset failed: job node failed; "
        "node 2 (pod deltarec-ctr-abc-node-0-2): node: Error, exit code 3; "
        "RuntimeError: rank 9 ran out of data"
    )
    assert core.selectors == ["jobset.sigs.k8s.io/jobset-name=deltarec-ctr-abc"]


def test_a_trainjob_is_deleted_when_following_it_fails_and_kept_when_it_completed():
    gets = []

    def flaky():
        gets.append(1)
        if len(gets) == 2:
            raise ApiException(500)

    api = FakeTrainerApi([RUNNING], on_get=flaky)
    with pytest.raises(ApiException):
        tj.run_train_job(spec(), api=api, core=FakeCoreApi(), poll_s=1, sleep=lambda s: None)
    assert api.deleted == [("deltarec-ctr-abc", "Foreground")]
    api = FakeTrainerApi([RUNNING, COMPLETE])
    tj.run_train_job(spec(), api=api, core=FakeCoreApi(), poll_s=1, sleep=lambda s: None)
    assert api.deleted == [] and len(api.objects) == 1


def test_a_cancelled_step_deletes_its_running_trainjob():
    api = FakeTrainerApi([RUNNING])

    def cancelled(_s):
        os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(pytorchjob.StepStopped, match="SIGTERM"):
        tj.run_train_job(spec(), api=api, core=FakeCoreApi(), poll_s=1, sleep=cancelled)
    assert api.deleted == [("deltarec-ctr-abc", "Foreground")] and not api.objects


def test_multi_node_train_step_creates_a_trainjob_by_default_and_reports_the_generation(
    tmp_path, monkeypatch
):
    api = FakeTrainerApi(
        [RUNNING, COMPLETE],
        on_get=lambda: write_generation(tmp_path, "ctr", [(100, {"t": 9})])
        if not os.listdir(tmp_path) else None,
    )  # fmt: skip
    monkeypatch.setattr(tj, "kubernetes_apis", lambda: (api, FakeCoreApi()))
    monkeypatch.setattr(pytorchjob, "current_namespace", lambda default="default": "ml")
    p = parse_params(run_name="ctr", artifact_root=str(tmp_path), store_url="sqlite:///s.db",
                     steps=100, nodes=2, ranks_per_node=4, gpus_per_node=2,
                     training_runtime="torch-cuda-128", metrics_port=9400)  # fmt: skip
    record = steps.train(p, job_id="kfp-run-1", secrets=["deltarec-credentials", ""])
    (job,) = api.created
    assert job["metadata"]["name"] == pytorchjob.job_name("ctr", "kfp-run-1")
    assert job["spec"]["runtimeRef"]["name"] == "torch-cuda-128"
    t = job["spec"]["trainer"]
    assert (t["numNodes"], t["numProcPerNode"]) == (2, 4)
    assert t["args"][t["args"].index("--metrics-port") + 1] == "9400"
    assert (record.generation, record.rows, record.last_step) == (1, 9, 100)


def test_a_local_job_folder_goes_with_its_launcher_and_one_left_by_a_killed_launcher_goes_next(
    tmp_path, monkeypatch
):
    import subprocess
    import sys
    import tempfile

    from deltarec.orchestrate.trainjob_local import JOB_TMP_PREFIX, job_tempdir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    left = tmp_path / f"{JOB_TMP_PREFIX}abc-{gone.pid}"  # its launcher was killed: no cleanup
    (left / "venv").mkdir(parents=True)
    running = tmp_path / f"{JOB_TMP_PREFIX}def-{os.getppid()}"  # a launcher still running
    running.mkdir()
    with job_tempdir() as ours:
        assert tempfile.gettempdir() == ours and ours.endswith(f"-{os.getpid()}")
        venv = tempfile.mkdtemp(prefix="deltarec-ctr-")  # as the SDK makes the job's venv
        assert os.path.dirname(venv) == ours
        assert not left.exists() and running.is_dir()
    assert tempfile.gettempdir() == str(tmp_path)
    assert not os.path.exists(ours) and running.is_dir()
