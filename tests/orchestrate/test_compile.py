"""Every component and the pipeline compile; the YAML wires the steps as documented and holds
no credential; submit sends it with the parameters to a KFP endpoint."""

import importlib.util
import pathlib

import pytest
import yaml

from deltarec.cli import main
from deltarec.orchestrate.images import TOOLS_IMAGE, TRAINER_IMAGE
from deltarec.orchestrate.params import PipelineParams

REPO = pathlib.Path(__file__).resolve().parents[2]
STEPS = [
    "provision", "train", "train_launcher", "verify_plan", "verify_partition", "verify",
    "promote", "verify_failed", "rollback", "compact_plan", "compact_partition", "compact_commit",
    "compact", "gc",
]  # fmt: skip
PARAMS = [
    "--run",
    "ctr-main",
    "--artifacts",
    "s3://bucket/artifacts",
    "--store",
    "postgresql://trainer@db.ml.svc:5432/emb",
    "--steps",
    "500",
]


def load_module(path):
    spec = importlib.util.spec_from_file_location(path.stem + "_" + path.parent.name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_component_has_a_documented_folder():
    from deltarec.orchestrate.components import COMPONENTS

    def listing(folder):
        return sorted(p.name for p in folder.iterdir() if p.name != "__pycache__")

    folders = [name for name in listing(REPO / "components") if "." not in name]
    assert folders == sorted([*STEPS, "params"]) == sorted(COMPONENTS)
    for step in [*STEPS, "params"]:
        assert listing(REPO / "components" / step) == ["README.md"]
        assert (REPO / "components" / step / "README.md").read_text().startswith(f"# {step}")


@pytest.mark.parametrize("step", STEPS)
def test_components_compile_py_compiles_each_step_on_the_pinned_image(step, tmp_path, capsys):
    out = tmp_path / f"{step}.yaml"
    assert load_module(REPO / "components" / "compile.py").main([step, str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    spec = yaml.safe_load(out.read_text())
    (executor,) = spec["deploymentSpec"]["executors"].values()
    container = executor["container"]
    assert container["image"] == (TRAINER_IMAGE if step == "train" else TOOLS_IMAGE)
    source = container["command"][-1]
    assert "from deltarec.orchestrate import steps" in source
    assert "packages_to_install" not in out.read_text() and "deltarec==" not in source


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "usage: python components/compile.py STEP [OUTPUT.yaml]"),
        (["trian"], "no step 'trian'; STEP: params | provision | train |"),
        (["train", "a.yaml", "b.yaml"], "usage:"),
    ],
)
def test_components_compile_py_refuses_a_wrong_call_naming_the_steps(argv, message, capsys):
    assert load_module(REPO / "components" / "compile.py").main(argv) == 2
    assert message in capsys.readouterr().err


def test_pipeline_compiles_by_default_to_deltarec_pipeline_yaml_in_the_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["pipeline", "compile", "--components", "comps"]) == 0
    spec = next(yaml.safe_load_all((tmp_path / "deltarec-pipeline.yaml").read_text()))
    written = sorted(p.name for p in (tmp_path / "comps").iterdir())
    assert written == [f"{s}.yaml" for s in sorted([*STEPS, "params"])]
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert list(params) == sorted(PipelineParams.names())
    assert {"entry_point", "tables", "webhook_url", "train_extra_args"} <= set(params)
    assert params["steps"]["defaultValue"] == 1000 and params["steps"]["isOptional"]
    assert params["run_name"] == {"parameterType": "STRING"}
    tasks = spec["root"]["dag"]["tasks"]
    comps = spec["components"]
    assert set(tasks) == {
        "params", "provision", "condition-branches-1", "compact-plan", "condition-branches-4",
        "verify-plan", "for-loop-8", "verify", "condition-9", "condition-11",
    }  # fmt: skip
    checked = tasks["params"]["inputs"]["parameters"]
    assert set(checked) == set(PipelineParams.names())
    for step in ("provision", "verify-plan", "verify"):
        assert tasks[step]["inputs"]["parameters"]["params"]["taskOutputParameter"] == {
            "outputParameterKey": "Output",
            "producerTask": "params",
        }
    # one node: the train task with GPUs; several: a CPU launcher task (the job's nodes hold them)
    branches = comps["comp-condition-branches-1"]["dag"]["tasks"]
    assert branches["condition-2"]["triggerPolicy"]["condition"] == (
        "int(inputs.parameter_values['pipelinechannel--nodes']) == 1"
    )
    assert list(comps["comp-condition-2"]["dag"]["tasks"]) == ["train"]
    assert list(comps["comp-condition-3"]["dag"]["tasks"]) == ["train-launcher"]
    assert tasks["condition-branches-1"]["dependentTasks"] == ["params", "provision"]
    executors = spec["deploymentSpec"]["executors"]
    accel = executors["exec-train"]["container"]["resources"]["accelerator"]
    assert accel["resourceType"] == "nvidia.com/gpu"
    assert accel["resourceCount"] == "{{$.inputs.parameters['pipelinechannel--gpus_per_node']}}"
    assert "resources" not in executors["exec-train-launcher"]["container"]
    assert executors["exec-train-launcher"]["container"]["image"] == TOOLS_IMAGE
    # compaction after train: a fan-out and its commit, or one task; verify reads its result
    assert tasks["compact-plan"]["dependentTasks"] == ["condition-branches-1", "params"]
    compaction = comps["comp-condition-branches-4"]["dag"]["tasks"]
    assert compaction["condition-6"]["triggerPolicy"]["condition"] == (
        "inputs.parameter_values['pipelinechannel--compact-plan-decision'] == 'fan-out'"
    )
    fan_out = comps["comp-condition-6"]["dag"]["tasks"]
    assert fan_out["compact-commit"]["dependentTasks"] == ["for-loop-5"]
    assert list(comps["comp-for-loop-5"]["dag"]["tasks"]) == ["compact-partition"]
    assert list(comps["comp-condition-7"]["dag"]["tasks"]) == ["compact"]
    base = tasks["verify-plan"]["inputs"]["parameters"]["base"]["taskOutputParameter"]
    assert base["producerTask"] == "condition-branches-4"  # after the compaction, either way
    # verify fans out over the plan's partitions; the gate collects them
    loop = tasks["for-loop-8"]
    items = loop["parameterIterator"]["items"]
    assert items == {"inputParameter": "pipelinechannel--verify-plan-Output"}
    assert list(comps["comp-for-loop-8"]["dag"]["tasks"]) == ["verify-partition"]
    gate = tasks["verify"]["inputs"]["parameters"]
    assert gate["partitions"]["taskOutputParameter"] == {
        "outputParameterKey": "pipelinechannel--verify-partition-Output",
        "producerTask": "for-loop-8",
    }
    assert gate["generation"]["taskOutputParameter"]["producerTask"] == "condition-branches-1"
    assert tasks["condition-9"]["triggerPolicy"]["condition"] == (
        "inputs.parameter_values['pipelinechannel--verify-Output'] == 'PASS'"
    )
    promoted = comps["comp-condition-9"]["dag"]["tasks"]  # promote, then gc unless it is off
    assert sorted(promoted) == ["condition-10", "promote"]
    assert promoted["condition-10"]["dependentTasks"] == ["promote"]
    assert promoted["condition-10"]["triggerPolicy"]["condition"] == (
        "inputs.parameter_values['pipelinechannel--gc_mode'] != 'off'"
    )
    assert list(comps["comp-condition-10"]["dag"]["tasks"]) == ["gc"]
    assert tasks["condition-11"]["triggerPolicy"]["condition"] == (
        "inputs.parameter_values['pipelinechannel--verify-Output'] == 'FAIL'"
    )
    failed = comps["comp-condition-11"]["dag"]["tasks"]["verify-failed"]
    assert failed["inputs"]["artifacts"]["report"]["componentInputArtifact"]
    assert all(t["cachingOptions"] == {} for t in tasks.values() if "cachingOptions" in t)


def test_pipeline_yaml_mounts_secrets_by_name_only(tmp_path):
    out = tmp_path / "p.yaml"
    assert (
        main(
            [
                "pipeline",
                "compile",
                "--output",
                str(out),
                "--secret",
                "pg-cred:password=PGPASSWORD",
                "--secret",
                "cloud",
            ]
        )
        == 0
    )
    docs = list(yaml.safe_load_all(out.read_text()))
    platform = docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert set(platform) == {
        "exec-provision", "exec-train", "exec-train-launcher", "exec-compact-plan",
        "exec-compact-partition", "exec-compact-commit", "exec-compact", "exec-verify-plan",
        "exec-verify-partition", "exec-verify", "exec-promote", "exec-gc", "exec-verify-failed",
    }  # fmt: skip
    env = platform["exec-train"]["secretAsEnv"]
    assert [s["secretName"] for s in env] == ["pg-cred", "cloud"]
    assert env[0]["keyToEnv"] == [{"envVar": "PGPASSWORD", "secretKey": "password"}]
    aws = {"envVar": "AWS_SECRET_ACCESS_KEY", "secretKey": "AWS_SECRET_ACCESS_KEY"}
    assert aws in env[1]["keyToEnv"]


def test_bad_secret_specs_are_refused_with_exit_code_2(tmp_path, capsys):
    out = str(tmp_path / "p.yaml")
    assert main(["pipeline", "compile", "--output", out, "--secret", "Bad_Name"]) == 2
    assert "Bad_Name" in capsys.readouterr().err
    assert main(["pipeline", "compile", "--output", out, "--secret", "ok:password"]) == 2
    assert not (tmp_path / "p.yaml").exists()


class FakeClient:
    calls = []

    def __init__(self, host=None, namespace=None):
        self.host, self.namespace = host, namespace

    def create_run_from_pipeline_package(self, pipeline_file, **kw):
        FakeClient.calls.append(
            {"host": self.host, "yaml": pathlib.Path(pipeline_file).read_text(), **kw}
        )

        class Result:
            run_id = "run-42"

        return Result()


@pytest.fixture
def fake_kfp(monkeypatch):
    import kfp

    FakeClient.calls = []
    monkeypatch.setattr(kfp, "Client", FakeClient)
    return FakeClient


def test_submit_sends_parameters_and_secret_names_but_never_the_secret_value(
    fake_kfp, monkeypatch, capsys, tmp_path
):
    secret_value = "s3cr3t-Pa55w0rd-9f2c"
    monkeypatch.setenv("PGPASSWORD", secret_value)  # the operator's shell holds the value
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret_value + "-aws")
    kept = tmp_path / "submitted.yaml"
    code = main(
        [
            "pipeline",
            "submit",
            "--host",
            "http://kfp.example:8888",
            "--namespace",
            "ml",
            "--experiment",
            "ctr",
            "--secret",
            "pg:password=PGPASSWORD",
            "--secret",
            "cloud",
            "--service-account",
            "deltarec-pipeline",
            "--output",
            str(kept),
            *PARAMS,
        ]
    )
    assert code == 0 and "submitted run run-42" in capsys.readouterr().out
    (call,) = fake_kfp.calls
    assert call["host"] == "http://kfp.example:8888" and call["namespace"] == "ml"
    assert call["experiment_name"] == "ctr" and call["service_account"] == "deltarec-pipeline"
    assert call["arguments"]["run_name"] == "ctr-main" and call["arguments"]["steps"] == 500
    assert call["arguments"]["store_url"] == "postgresql://trainer@db.ml.svc:5432/emb"
    assert "secretName: pg" in call["yaml"] and "envVar: PGPASSWORD" in call["yaml"]
    for text in (call["yaml"], kept.read_text(), repr(call["arguments"])):
        assert secret_value not in text


@pytest.mark.parametrize(
    "store",
    ["postgresql://trainer:hunter2@db:5432/emb", "redis://db:6379/0?password=hunter2"],
)
def test_submit_refuses_a_store_url_with_a_password_and_sends_nothing(fake_kfp, capsys, store):
    args = ["pipeline", "submit", "--host", "http://kfp", *PARAMS[:4], "--store", store]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "store_url" in err and "Secret" in err and "hunter2" not in err
    assert fake_kfp.calls == []


def test_run_requires_local(capsys):
    assert main(["pipeline", "run", *PARAMS]) == 2
    assert "only --local" in capsys.readouterr().err


def test_checkout_entry_points_compile_the_pipeline_and_a_component(tmp_path):
    import subprocess
    import sys

    scripts = [(REPO / "pipelines" / "deltarec_pipeline.py", tmp_path / "pipeline.yaml")]
    scripts += [(REPO / "components" / "compile.py", "train", tmp_path / "train.yaml")]
    for script, *args, out in scripts:
        done = subprocess.run(
            [sys.executable, str(script), *args, str(out)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip() == str(out)
        assert yaml.safe_load_all(out.read_text())  # parses
    pipeline = next(yaml.safe_load_all((tmp_path / "pipeline.yaml").read_text()))
    assert pipeline["pipelineInfo"]["name"] == "deltarec"
    train = yaml.safe_load((tmp_path / "train.yaml").read_text())
    assert "generation" in train["root"]["outputDefinitions"]["artifacts"]


@pytest.mark.parametrize(
    "args, problem",
    [
        (["--store", ""], "store_url: String should have at least 1 character"),
        (["--dump-every-steps", "0"], "both 0"),
        (["--nodes", "0"], "nodes: Input should be greater than or equal to 1"),
        (["--run", "bad/run"], "invalid run name 'bad/run'"),
    ],
)
def test_bad_pipeline_parameters_are_exit_code_2_naming_the_parameter(args, problem, capsys):
    assert main(["pipeline", "run", "--local", *PARAMS, *args]) == 2
    assert problem in capsys.readouterr().err
