"""The multi-node train path at the Kubernetes API boundary: a fake CustomObjectsApi, no cluster."""

import pytest

from deltarec.errors import BadInputError
from deltarec.orchestrate import pytorchjob as pj
from deltarec.orchestrate.types import TrainJobFailedError


class ApiException(Exception):
    def __init__(self, status):
        super().__init__(f"HTTP {status}")
        self.status = status


class FakeCustomObjectsApi:
    """Stores created objects; each get returns the next status from a script."""

    resource = ("kubeflow.org", "v1", "pytorchjobs")
    """The (group, version, plural) the code under test must ask for."""

    def __init__(self, statuses=(), existing=None):
        self.objects = dict(existing or {})
        self.statuses = list(statuses)
        self.created = []
        self.gets = 0

    def check(self, body):
        """Refuse a body the API server would refuse (here: none)."""

    def create_namespaced_custom_object(self, group, version, namespace, plural, body):
        assert (group, version, plural) == self.resource
        self.check(body)
        key = (namespace, body["metadata"]["name"])
        if key in self.objects:
            raise ApiException(409)
        self.objects[key] = body
        self.created.append(body)
        return body

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        self.gets += 1
        obj = dict(self.objects[(namespace, name)])
        if self.statuses:
            obj["status"] = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        return obj


def cond(kind, status="True", reason="", message=""):
    return {"type": kind, "status": status, "reason": reason, "message": message}


def spec(**kw):
    base = dict(
        name="deltarec-ctr-abc",
        namespace="ml",
        image="ghcr.io/deltarec/deltarec-trainer:0.1.0",
        nodes=3,
        procs_per_node=8,
        gpus_per_node=8,
        train_args=("--artifacts", "s3://b/a", "--run", "ctr", "--steps", "100"),
        secrets=("deltarec-credentials",),
        service_account="deltarec-pipeline",
        timeout_s=600,
    )
    base.update(kw)
    return pj.TrainJobSpec(**base)


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


def test_manifest_has_one_master_and_nodes_minus_one_workers_running_torchrun():
    m = pj.build_manifest(spec())
    assert m["apiVersion"] == "kubeflow.org/v1" and m["kind"] == "PyTorchJob"
    assert m["metadata"] == {
        "name": "deltarec-ctr-abc",
        "namespace": "ml",
        "labels": {"app.kubernetes.io/part-of": "deltarec"},
    }
    replicas = m["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 2
    assert m["spec"]["nprocPerNode"] == "8"
    assert m["spec"]["runPolicy"]["backoffLimit"] == 0
    assert m["spec"]["runPolicy"]["activeDeadlineSeconds"] == 600
    for role in ("Master", "Worker"):
        pod = replicas[role]["template"]["spec"]
        assert replicas[role]["restartPolicy"] == "Never"
        assert pod["serviceAccountName"] == "deltarec-pipeline"
        (c,) = pod["containers"]
        assert c["name"] == "pytorch" and c["image"].endswith("deltarec-trainer:0.1.0")
        assert c["command"] == [
            "torchrun",
            "--nnodes",
            "3",
            "--nproc-per-node",
            "8",
            "--no-python",
            "--",
            "deltarec",
            "train",
        ]
        assert c["args"][:2] == ["--device", "cuda"]
        assert c["args"][2:] == list(spec().train_args)
        assert c["resources"] == {"limits": {"nvidia.com/gpu": 8}}
        assert "envFrom" not in c  # key by key, never the whole Secret
        assert c["env"][0] == {"name": "PGPASSWORD", "valueFrom": {"secretKeyRef": {
            "name": "deltarec-credentials", "key": "PGPASSWORD", "optional": True}}}  # fmt: skip
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["automountServiceAccountToken"] is False
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert {m["mountPath"] for m in c["volumeMounts"]} == {"/tmp", "/home/deltarec"}


def test_cpu_job_on_one_node_has_no_workers_gpus_or_secrets():
    m = pj.build_manifest(spec(nodes=1, gpus_per_node=0, secrets=(), service_account=None))
    replicas = m["spec"]["pytorchReplicaSpecs"]
    assert list(replicas) == ["Master"]
    pod = replicas["Master"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["args"][:2] == ["--device", "cpu"]
    assert "resources" not in c and "env" not in c and "serviceAccountName" not in pod


def test_bad_job_sizes_and_names_are_rejected_with_the_values():
    with pytest.raises(BadInputError, match="nodes=0"):
        spec(nodes=0)
    with pytest.raises(BadInputError, match="DNS-1123"):
        spec(name="Deltarec_CTR")


def test_job_name_is_stable_per_pipeline_run_and_a_valid_kubernetes_name():
    a = pj.job_name("CTR_main.v2", "run-1")
    assert a == pj.job_name("CTR_main.v2", "run-1") != pj.job_name("CTR_main.v2", "run-2")
    assert a.startswith("deltarec-ctr-main-v2-") and len(a) <= 63
    spec(name=a)  # accepted as DNS-1123
    assert len(pj.job_name("x" * 200, "r")) <= 63


def test_run_creates_the_job_and_returns_when_it_succeeds():
    api = FakeCustomObjectsApi(
        statuses=[
            {},
            {"conditions": [cond("Created")]},
            {"conditions": [cond("Created"), cond("Running")]},
            {"conditions": [cond("Created"), cond("Running", "False"), cond("Succeeded")]},
        ]
    )
    clock = FakeClock()
    final = pj.run_train_job(spec(), api, poll_s=5, sleep=clock.sleep)
    assert len(api.created) == 1 and api.created[0]["metadata"]["name"] == "deltarec-ctr-abc"
    assert pj.job_state(final) == ("Succeeded", "")
    assert api.gets == 4 and clock.t == 15


def test_failed_job_fails_the_step_with_the_operators_reason():
    api = FakeCustomObjectsApi(
        statuses=[
            {"conditions": [cond("Running")]},
            {
                "conditions": [
                    cond("Running", "False"),
                    cond("Failed", reason="PyTorchJobFailed", message="pod worker-1 exit 137"),
                ]
            },
        ]
    )
    with pytest.raises(TrainJobFailedError, match="ml/deltarec-ctr-abc: failed: PyTorchJobFailed"):
        pj.run_train_job(spec(), api, poll_s=1, sleep=lambda s: None)


def test_job_that_never_finishes_times_out_naming_the_last_state():
    api = FakeCustomObjectsApi(statuses=[{"conditions": [cond("Running")]}])
    api.objects[("ml", "j")] = {"metadata": {"name": "j"}}
    clock = FakeClock()
    with pytest.raises(TrainJobFailedError, match=r"within 60 s \(last state Running\)"):
        pj.PYTORCHJOB.wait(api, "ml", "j", timeout_s=60, poll_s=10, clock=clock, sleep=clock.sleep)
    assert clock.t == 60 and api.gets == 7


def test_retried_step_follows_the_existing_job_instead_of_creating_another():
    existing = {("ml", "deltarec-ctr-abc"): pj.build_manifest(spec())}
    api = FakeCustomObjectsApi(statuses=[{"conditions": [cond("Succeeded")]}], existing=existing)
    pj.run_train_job(spec(), api, poll_s=1, sleep=lambda s: None)
    assert api.created == []


def test_retried_step_refuses_to_follow_an_existing_failed_job():
    existing = {("ml", "deltarec-ctr-abc"): pj.build_manifest(spec())}
    api = FakeCustomObjectsApi(
        statuses=[{"conditions": [cond("Failed", message="OOMKilled")]}], existing=existing
    )
    with pytest.raises(TrainJobFailedError, match="earlier attempt and failed: OOMKilled"):
        pj.run_train_job(spec(), api, poll_s=1, sleep=lambda s: None)


def test_api_errors_other_than_conflict_fail_the_step():
    class Forbidden(FakeCustomObjectsApi):
        def create_namespaced_custom_object(self, *a, **k):
            raise ApiException(403)

    with pytest.raises(TrainJobFailedError, match="could not be created: HTTP 403"):
        pj.run_train_job(spec(), Forbidden(), poll_s=1, sleep=lambda s: None)


def test_pod_command_parses_under_torchruns_own_parser_with_every_training_flag_intact():
    run = pytest.importorskip("torch.distributed.run", reason="torch is not installed")
    c = pj.build_manifest(spec())["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    container = c["containers"][0]
    args = run.get_args_parser().parse_args(container["command"][1:] + container["args"])
    assert (args.nnodes, args.nproc_per_node, args.no_python) == ("3", "8", True)
    assert args.training_script == "deltarec"
    assert args.training_script_args == ["train", *container["args"]]  # --run survives
