"""The Helm chart renders with Helm's own SDK, its schema guards the values, and the rendered
manifests and plain YAML files are clean under yamllint."""

import pathlib
import subprocess
import sys

import pytest
import yaml

from deltarec.credentials import check_no_credentials
from deltarec.orchestrate.types import (
    CONTAINER_SECURITY_CONTEXT,
    CREDENTIAL_ENV,
    POD_SECURITY_CONTEXT,
)

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (dev extra) is not installed")

CHART = pathlib.Path(__file__).resolve().parents[2] / "charts" / "deltarec"
VALUES = {
    "run": "ctr-main",
    "store": {"url": "postgresql://trainer@db.ml.svc:5432/emb"},
    "artifacts": {"root": "s3://bucket/deltarec"},
}
BIN = pathlib.Path(sys.executable).parent


def render(values):
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name="dr", namespace="ml")
    return {pathlib.Path(k).name: v for k, v in files.items() if k.endswith(".yaml")}


def objects(files):
    docs = [d for text in files.values() for d in yaml.safe_load_all(text) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def yamllint(paths):
    cmd = [
        str(BIN / "yamllint"),
        "-c",
        str(CHART / ".yamllint"),
        "-f",
        "parsable",
        *map(str, paths),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_chart_renders_config_rbac_for_trainjobs_pytorchjobs_and_the_scheduled_verify():
    objs = objects(render(VALUES))
    assert set(objs) == {
        ("ConfigMap", "dr-deltarec-config"),
        ("ServiceAccount", "deltarec-pipeline"),
        ("ServiceAccount", "deltarec-launcher"),
        ("Secret", "deltarec-launcher-token"),
        ("Role", "dr-deltarec-train-launcher"),
        ("RoleBinding", "dr-deltarec-train-launcher"),
        ("CronJob", "dr-deltarec-verify"),
    }
    config = objs[("ConfigMap", "dr-deltarec-config")]["data"]
    assert config["DELTAREC_STORE_URL"] == "postgresql://trainer@db.ml.svc:5432/emb"
    rules = objs[("Role", "dr-deltarec-train-launcher")]["rules"]
    assert {"apiGroups": ["kubeflow.org"], "resources": ["pytorchjobs"],
            "verbs": ["create", "get", "list", "watch", "delete"]} in rules  # fmt: skip
    assert {"apiGroups": ["trainer.kubeflow.org"], "resources": ["trainjobs"],
            "verbs": ["create", "get", "list", "watch", "delete"]} in rules  # fmt: skip
    assert {"apiGroups": [""], "resources": ["pods", "pods/log", "events"],
            "verbs": ["get", "list", "watch"]} in rules  # fmt: skip
    binding = objs[("RoleBinding", "dr-deltarec-train-launcher")]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "deltarec-launcher", "namespace": "ml"}
    ]
    job = objs[("CronJob", "dr-deltarec-verify")]["spec"]["jobTemplate"]["spec"]["template"]
    (c,) = job["spec"]["containers"]
    assert c["image"] == "ghcr.io/deltarec/deltarec-tools:0.1.0"
    assert c["command"] == ["deltarec"] and c["args"][:2] == ["pipeline", "verify-serving"]
    assert "$(DELTAREC_STORE_URL)" in c["args"] and c["args"][-1] == "10000"
    assert "--run" not in c["args"]  # the scheduled check follows the run that serves
    assert c["envFrom"] == [{"configMapRef": {"name": "dr-deltarec-config"}}]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"] if "valueFrom" in e}
    assert refs == {k: {"name": "deltarec-credentials", "key": k, "optional": True}
                    for k in CREDENTIAL_ENV}  # fmt: skip
    assert job["spec"]["securityContext"]["runAsNonRoot"] is True


def test_the_scheduled_check_can_be_pinned_to_the_chart_run_which_must_serve():
    pinned = {**VALUES, "verifyCronJob": {"enabled": True, "schedule": "*/30 * * * *",
                                          "sample": 10000, "followServing": False}}  # fmt: skip
    objs = objects(render(pinned))
    job = objs[("CronJob", "dr-deltarec-verify")]["spec"]["jobTemplate"]["spec"]["template"]
    (c,) = job["spec"]["containers"]
    i = c["args"].index("--run")
    assert c["args"][i + 1] == "$(DELTAREC_RUN)"


def test_chart_options_drop_the_cronjob_and_bind_extra_service_accounts():
    values = {
        **VALUES,
        "verifyCronJob": {"enabled": False, "schedule": "0 * * * *", "sample": 0},
        "rbac": {"create": True, "extraServiceAccounts": ["default-editor"]},
        "credentials": {"existingSecret": ""},
    }
    objs = objects(render(values))
    assert not any(kind == "CronJob" for kind, _ in objs)
    subjects = objs[("RoleBinding", "dr-deltarec-train-launcher")]["subjects"]
    assert [s["name"] for s in subjects] == ["deltarec-launcher", "default-editor"]


def test_chart_deploys_serving_replicas_that_follow_the_promoted_generation(tmp_path):
    values = {**VALUES, "replica": {"enabled": True, "replicas": 3, "device": "cuda"}}
    files = render(values)
    objs = objects(files)
    deploy = objs[("Deployment", "dr-deltarec-replica")]["spec"]
    assert deploy["replicas"] == 3
    (c,) = deploy["template"]["spec"]["containers"]
    assert c["image"] == "ghcr.io/deltarec/deltarec-trainer:0.1.0"
    assert c["command"] == ["deltarec"] and c["args"][0] == "serve"
    assert "$(DELTAREC_STORE_URL)" in c["args"] and "--no-follow" not in c["args"]
    assert c["args"][c["args"].index("--device") + 1] == "cuda"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert objs[("Service", "dr-deltarec-replica")]["spec"]["ports"][0]["port"] == 8470
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    result = yamllint([tmp_path])
    assert result.returncode == 0, result.stdout + result.stderr
    with pytest.raises(helm.HelmError, match="device"):
        render({**VALUES, "replica": {"enabled": True, "device": "tpu"}})


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"store": {"url": "postgresql://trainer:hunter2@db:5432/emb"}}, "/store/url"),
        ({"run": "bad name"}, "/run"),
        ({"colour": "blue"}, "colour"),
        ({"run": ""}, "/run"),
    ],
)
def test_schema_rejects_passwords_in_urls_bad_names_and_unknown_keys(change, problem):
    with pytest.raises(helm.HelmError, match=problem):
        render({**VALUES, **change})


def test_rendered_manifests_and_plain_yaml_are_clean_under_yamllint(tmp_path):
    for name, text in render(VALUES).items():
        (tmp_path / name).write_text(text)
    result = yamllint([tmp_path, CHART / "Chart.yaml", CHART / "values.yaml"])
    assert result.returncode == 0, result.stdout + result.stderr


def test_yamllint_does_catch_a_broken_manifest(tmp_path):
    (tmp_path / "bad.yaml").write_text("---\nkey: [unclosed\n")
    result = yamllint([tmp_path / "bad.yaml"])
    assert result.returncode != 0 and "syntax" in result.stdout


def test_helm_lint_passes_with_the_required_values():
    report = helm.lint(str(CHART), VALUES, strict=True)
    errors = [m for m in report["messages"] if m["severity"] >= 2]
    assert errors == [] and report["errors"] == []


def _pod_specs(objs):
    """``(name, pod spec)`` of every workload the chart renders."""
    for (kind, name), obj in objs.items():
        if kind == "CronJob":
            yield name, obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        elif kind == "Deployment":
            yield name, obj["spec"]["template"]["spec"]


def test_only_the_launcher_account_may_create_jobs_and_no_workload_mounts_a_token():
    objs = objects(render({**VALUES, "replica": {"enabled": True}}))
    bindings = [o for (kind, _), o in objs.items() if kind in ("RoleBinding", "ClusterRoleBinding")]
    bound = {s["name"] for b in bindings for s in b["subjects"]}
    assert bound == {"deltarec-launcher"}
    (role,) = [o for (kind, _), o in objs.items() if kind == "Role"]
    creates = {r for rule in role["rules"] if "create" in rule["verbs"] for r in rule["resources"]}
    assert creates == {"pytorchjobs", "trainjobs"}  # no pods, secrets or roles
    steps = objs[("ServiceAccount", "deltarec-pipeline")]
    assert steps["automountServiceAccountToken"] is False
    pods = dict(_pod_specs(objs))
    assert set(pods) == {"dr-deltarec-verify", "dr-deltarec-replica"}
    for name, pod in pods.items():
        assert pod["serviceAccountName"] == "deltarec-pipeline", name
        assert pod["automountServiceAccountToken"] is False, name
        assert pod["securityContext"] == POD_SECURITY_CONTEXT, name
        (c,) = pod["containers"]
        assert c["securityContext"] == CONTAINER_SECURITY_CONTEXT, name
        assert all("secretRef" not in e for e in c.get("envFrom", [])), name  # keys only
    token = objs[("Secret", "deltarec-launcher-token")]
    assert token["type"] == "kubernetes.io/service-account-token" and "data" not in token
    assert token["metadata"]["annotations"] == {
        "kubernetes.io/service-account.name": "deltarec-launcher"
    }


def test_the_replicas_port_is_open_only_to_the_releases_pods_labelled_clients_and_listed_peers():
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "serving"}}}
    policy_values = {"enabled": True, "from": [peer]}
    values = {**VALUES, "replica": {"enabled": True, "networkPolicy": policy_values}}
    objs = objects(render(values))
    policy = objs[("NetworkPolicy", "dr-deltarec-replica")]["spec"]
    deploy = objs[("Deployment", "dr-deltarec-replica")]["spec"]["template"]["metadata"]
    assert policy["podSelector"]["matchLabels"].items() <= deploy["labels"].items()
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"port": 8470, "protocol": "TCP"}]
    assert rule["from"] == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/instance": "dr"}}},
        {"podSelector": {"matchLabels": {"deltarec.io/replica-client": "true"}}},
        peer,
    ]
    off = objects(
        render({**VALUES, "replica": {"enabled": True, "networkPolicy": {"enabled": False}}})
    )
    assert not any(kind == "NetworkPolicy" for kind, _ in off)


def test_the_charts_credential_keys_and_launcher_token_are_the_codes():
    from deltarec.orchestrate.types import LAUNCHER_TOKEN_SECRET

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["credentials"]["keys"] == list(CREDENTIAL_ENV)
    assert values["rbac"]["launcherTokenSecret"] == LAUNCHER_TOKEN_SECRET


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://trainer@db:5432/emb?password=hunter2",
        "redis://db:6379/0?token=hunter2",
        "postgresql://trainer@db/emb?sslpassword=hunter2",
        "featurestore://p/v?region=r&registry=postgresql://reg:hunter2@db/reg",
        "featurestore://p/v?region=r&access_key=hunter2",
        "postgresql://trainer@db.ml.svc:5432/emb?layout=bytea",
        "featurestore://p/v?region=r&registry=postgresql://reg@db/reg",
        "redis://db:6379/0?prefix=emb:",
    ],
)
def test_the_schema_refuses_exactly_the_store_urls_the_code_refuses(url):
    try:
        check_no_credentials("store_url", url)
        refused = False
    except ValueError:
        refused = True
    if refused:
        with pytest.raises(helm.HelmError, match="/store/url"):
            render({**VALUES, "store": {"url": url}})
    else:
        assert objects(render({**VALUES, "store": {"url": url}}))


def test_dense_every_reaches_the_config_and_makes_the_replicas_score():
    values = {**VALUES, "denseEvery": 5, "replica": {"enabled": True}}
    objs = objects(render(values))
    assert objs[("ConfigMap", "dr-deltarec-config")]["data"]["DELTAREC_DENSE_EVERY"] == "5"
    deploy = objs[("Deployment", "dr-deltarec-replica")]["spec"]["template"]["spec"]
    assert "--score" in deploy["containers"][0]["args"]
    plain = objects(render({**VALUES, "replica": {"enabled": True}}))
    assert "DELTAREC_DENSE_EVERY" not in plain[("ConfigMap", "dr-deltarec-config")]["data"]
    args = plain[("Deployment", "dr-deltarec-replica")]["spec"]["template"]["spec"]
    assert "--score" not in args["containers"][0]["args"]
    with pytest.raises(helm.HelmError, match="denseEvery"):
        render({**VALUES, "denseEvery": -1})


def test_only_the_replicas_get_the_replica_token_from_the_credentials_secret():
    creds = {"existingSecret": "deltarec-creds"}
    values = {**VALUES, "credentials": creds, "replica": {"enabled": True}}
    objs = objects(render(values))

    def env_of(kind, name):
        spec = objs[(kind, name)]["spec"]
        if kind == "CronJob":
            spec = spec["jobTemplate"]["spec"]
        (c,) = spec["template"]["spec"]["containers"]
        return {e["name"]: e for e in c.get("env", [])}

    token = env_of("Deployment", "dr-deltarec-replica")["DELTAREC_REPLICA_TOKEN"]
    ref = token["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "deltarec-creds", "key": "DELTAREC_REPLICA_TOKEN", "optional": True}
    for kind, name in objs:
        if kind in {"CronJob", "Deployment"} and name != "dr-deltarec-replica":
            assert "DELTAREC_REPLICA_TOKEN" not in env_of(kind, name), name
    off = objects(render({**values, "replica": {"enabled": True, "tokenKey": ""}}))
    (c,) = off[("Deployment", "dr-deltarec-replica")]["spec"]["template"]["spec"]["containers"]
    assert "DELTAREC_REPLICA_TOKEN" not in {e["name"] for e in c.get("env", [])}


def test_the_scheduled_gc_is_off_by_default_and_runs_deltarec_gc_for_the_chart_run():
    assert not any(
        kind == "CronJob" and name.endswith("-gc") for kind, name in objects(render(VALUES))
    )
    values = {**VALUES, "gcCronJob": {"enabled": True, "schedule": "17 3 * * *",
                                      "keepPromotions": 5, "dryRun": True,
                                      "checkpoints": ["2:1200", "3:400"]}}  # fmt: skip
    objs = objects(render(values))
    cron = objs[("CronJob", "dr-deltarec-gc")]
    assert cron["spec"]["schedule"] == "17 3 * * *"
    (c,) = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["deltarec"]
    assert c["args"] == [
        "gc", "--artifacts", "$(DELTAREC_ARTIFACT_ROOT)", "--run", "$(DELTAREC_RUN)",
        "--store", "$(DELTAREC_STORE_URL)", "--keep-promotions", "5",
        "--checkpoint", "2:1200", "--checkpoint", "3:400", "--dry-run",
    ]  # fmt: skip
    assert c["envFrom"] == [{"configMapRef": {"name": "dr-deltarec-config"}}]


def test_the_scheduled_gc_reads_the_trainers_checkpoints_from_their_volume_claim():
    values = {**VALUES, "gcCronJob": {"enabled": True, "schedule": "17 3 * * *",
                                      "checkpointsFrom": {"claimName": "work",
                                                          "path": "/runs/demo/"}}}  # fmt: skip
    cron = objects(render(values))[("CronJob", "dr-deltarec-gc")]
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    at = c["args"].index("--checkpoints-from")
    assert c["args"][at + 1] == "/var/lib/deltarec/workdir/runs/demo"
    mount = {"name": "checkpoints", "mountPath": "/var/lib/deltarec/workdir", "readOnly": True}
    assert mount in c["volumeMounts"]
    claim = {"claimName": "work", "readOnly": True}
    assert {"name": "checkpoints", "persistentVolumeClaim": claim} in pod["volumes"]


def test_a_gc_checkpoint_that_is_not_generation_colon_step_is_refused():
    values = {**VALUES, "gcCronJob": {"enabled": True, "schedule": "17 3 * * *",
                                      "checkpoints": ["3-400"]}}  # fmt: skip
    with pytest.raises(helm.HelmError, match="checkpoints"):
        render(values)
