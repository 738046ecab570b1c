"""Every credential the docs ask users to store reaches every step that opens a store.

The list is one definition, :data:`deltarec.orchestrate.types.CREDENTIAL_ENV`; these tests
derive everything from it and read what users read (the docs) and what clusters run (the
compiled KFP YAML, the Airflow DAG file and its pods, the TrainJob and PyTorchJob manifests).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from deltarec.cli import main
from deltarec.orchestrate.types import CREDENTIAL_ENV, DEFAULT_SECRET

from .conftest import check_dag_folder

DOCS = Path(__file__).resolve().parents[2] / "docs"
STORE_STEPS = {"provision", "train", "verify", "promote", "verify-failed"}
"""The pipeline's steps that open the store (the params step only checks parameters)."""


def _documented(page: str) -> set[str]:
    """The keys a page's ``<!-- credentials -->`` block tells users to store."""
    text = (DOCS / page).read_text()
    block = re.search(r"<!-- credentials:.*?-->(.*?)<!-- /credentials -->", text, re.S)
    assert block, f"docs/{page} has no credentials block"
    return set(re.findall(r"`([A-Z][A-Z0-9_]+)`", block.group(1)))


def test_every_credential_the_docs_ask_for_is_in_the_one_list():
    featurestore = _documented("featurestore.md")
    assert "ALIBABA_CLOUD_SECURITY_TOKEN" in featurestore and "FEATUREDB_PASSWORD" in featurestore
    oss = _documented("artifact-roots.md")
    assert {"FSSPEC_OSS_KEY", "FSSPEC_OSS_SECRET"} <= oss
    assert featurestore | oss <= set(CREDENTIAL_ENV), sorted(
        (featurestore | oss) - set(CREDENTIAL_ENV)
    )
    assert len(set(CREDENTIAL_ENV)) == len(CREDENTIAL_ENV)


def test_the_pipeline_docs_list_exactly_the_keys_the_code_mounts():
    assert _documented("pipeline.md") == set(CREDENTIAL_ENV)


def test_the_compiled_kfp_pipeline_mounts_every_credential_in_every_step_that_opens_a_store(
    tmp_path,
):
    out = tmp_path / "pipeline.yaml"
    assert main(["pipeline", "compile", "--output", str(out)]) == 0
    text = out.read_text()
    spec, platform = list(yaml.safe_load_all(text))
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert {e.removeprefix("exec-") for e in executors} >= STORE_STEPS
    assert set(spec["deploymentSpec"]["executors"]) == {*executors, "exec-params"}  # all steps
    for name, executor in executors.items():
        (secret,) = executor["secretAsEnv"]
        assert secret["secretName"] == DEFAULT_SECRET and secret["optional"] is True
        mounted = {(k["secretKey"], k["envVar"]) for k in secret["keyToEnv"]}
        assert mounted == {(k, k) for k in CREDENTIAL_ENV}, name
    # the train steps (one node, or the launcher of several) hand the Secret's name to the pods
    dags = [spec["root"], *spec["components"].values()]
    handed = {
        name: task["inputs"]["parameters"]["credentials_secret"]["runtimeValue"]["constant"]
        for d in dags
        for name, task in d.get("dag", {}).get("tasks", {}).items()
        if "credentials_secret" in task.get("inputs", {}).get("parameters", {})
    }
    assert handed == {"train": DEFAULT_SECRET, "train-launcher": DEFAULT_SECRET}
    assert "test-secret" not in text and "password=" not in text  # names only


def test_the_airflow_dag_mounts_every_credential_in_every_pod(tmp_path, monkeypatch):
    pytest.importorskip("airflow")
    monkeypatch.setenv("DELTAREC_AIRFLOW_SERVICE_ACCOUNT", "deltarec-pipeline")
    monkeypatch.setenv("DELTAREC_AIRFLOW_LAUNCHER_SERVICE_ACCOUNT", "deltarec-launcher")
    dags = tmp_path / "dags"
    dag_file = dags / "deltarec_dag.py"
    assert main(["pipeline", "compile", "--engine", "airflow", "--output", str(dag_file)]) == 0
    written = dag_file.read_text()
    assert all(f"'{k}': '{k}'" in written for k in CREDENTIAL_ENV)  # the file's own copy
    tasks = check_dag_folder(dags, tmp_path)["tasks"]
    pods = {t: v for t, v in tasks.items() if v["operator"] == "KubernetesPodOperator"}
    assert {t.replace("_", "-") for t in pods} >= STORE_STEPS
    for name, pod in pods.items():
        assert sorted(map(tuple, pod["env"])) == sorted(
            (k, DEFAULT_SECRET, k) for k in CREDENTIAL_ENV
        ), name
    assert pods["train"]["arguments"][-2:] == ["--secrets", DEFAULT_SECRET]
    # only the launcher may create jobs: its account, and the only mounted token
    accounts = {n: (p["service_account"], p["automount_token"]) for n, p in pods.items()}
    assert accounts.pop("train_launcher") == ("deltarec-launcher", True)
    assert set(accounts.values()) == {("deltarec-pipeline", False)}, accounts


def test_multi_node_training_pods_get_every_credential_of_the_secret():
    pytest.importorskip("kubeflow_trainer_api")
    from deltarec.orchestrate import pytorchjob, trainjob

    spec = pytorchjob.TrainJobSpec(
        name="deltarec-ctr-1", namespace="ml", image="trainer:1", nodes=2, procs_per_node=1,
        gpus_per_node=0, train_args=("--run", "ctr"), secrets=(DEFAULT_SECRET,),
    )  # fmt: skip
    env = trainjob.build_train_job(spec).to_dict()["spec"]["trainer"]["env"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in env if "valueFrom" in e}
    assert refs == {k: {"name": DEFAULT_SECRET, "key": k, "optional": True} for k in CREDENTIAL_ENV}
    manifest = pytorchjob.build_manifest(spec)
    for replica in manifest["spec"]["pytorchReplicaSpecs"].values():
        (container,) = replica["template"]["spec"]["containers"]
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
        assert refs == {
            k: {"name": DEFAULT_SECRET, "key": k, "optional": True} for k in CREDENTIAL_ENV
        }
        assert "envFrom" not in container


def test_only_the_launcher_step_of_the_compiled_pipeline_gets_the_launcher_token(tmp_path):
    from deltarec.orchestrate.pytorchjob import LAUNCHER_TOKEN_DIR
    from deltarec.orchestrate.types import LAUNCHER_TOKEN_SECRET

    out = tmp_path / "pipeline.yaml"
    assert main(["pipeline", "compile", "--output", str(out)]) == 0
    _, platform = list(yaml.safe_load_all(out.read_text()))
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    mounted = {name: e["secretAsVolume"] for name, e in executors.items() if "secretAsVolume" in e}
    assert list(mounted) == ["exec-train-launcher"]
    (volume,) = mounted["exec-train-launcher"]
    assert volume["secretName"] == LAUNCHER_TOKEN_SECRET and volume["optional"] is True
    assert volume["mountPath"] == LAUNCHER_TOKEN_DIR


def test_the_launcher_talks_to_the_api_with_the_mounted_launcher_token(tmp_path, monkeypatch):
    from kubernetes import client

    from deltarec.orchestrate import pytorchjob

    (tmp_path / "token").write_text("launcher-token-value\n")
    (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    (tmp_path / "namespace").write_text("ml-team\n")
    monkeypatch.setattr(pytorchjob, "LAUNCHER_TOKEN_DIR", str(tmp_path))
    monkeypatch.setattr(client.Configuration, "_default", None)  # restored afterwards
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    assert pytorchjob.load_cluster_config() == "launcher token"
    config = client.Configuration.get_default_copy()
    assert config.host == "https://10.0.0.1:443"
    assert config.api_key["authorization"].strip().lower() == "bearer launcher-token-value"
    assert pytorchjob.current_namespace() == "ml-team"
