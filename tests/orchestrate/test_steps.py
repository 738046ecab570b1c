"""The step library without an engine: typed inputs, the programs train runs, the records the
steps hand on, failures."""

import json
import re
import sys

import pytest

from deltarec.errors import BadInputError, ConfigError
from deltarec.orchestrate import pytorchjob, steps
from deltarec.orchestrate.params import PipelineParams, parse_params
from deltarec.orchestrate.types import GenerationRecord, StepFailedError

from .conftest import FakeArtifact, write_generation


def params(tmp_path=None, **change):
    values = dict(
        run_name="r", artifact_root=str(tmp_path or "/a"), store_url="sqlite:///s.db",
        steps=50, dump_every_steps=10, ranks_per_node=2,
    )  # fmt: skip
    values.update(change)
    return parse_params(**values)


def test_example_model_gets_deltarec_train_flags_from_the_parameters():
    p = params(publish_mode="staged", checkpoint_dir="/c", train_extra_args="--seed 3")
    assert steps.train_args(p) == [
        "--artifacts", "/a", "--run", "r", "--steps", "50", "--dump-every-steps", "10",
        "--store", "sqlite:///s.db", "--publish-mode", "staged", "--workdir", "/c",
        "--seed", "3",
    ]  # fmt: skip
    no_steps = steps.train_args(params(dump_every_steps=0, dump_every_minutes=0.5))
    assert "--dump-every-steps" not in no_steps
    assert no_steps[6:8] == ["--dump-every-minutes", "0.5"]
    cmd, env = steps.torchrun_command(params(gpus_per_node=1))
    assert cmd[:5] == [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc-per-node=2"]  # fmt: skip
    assert cmd[5:10] == ["-m", "deltarec.train", "--", "--device", "cuda"] and env == {}


def test_entry_point_function_runs_on_every_rank_with_the_settings_in_the_environment():
    p = params(entry_point="team.train:main", train_extra_args="--export /x",
               dump_every_minutes=2.5, checkpoint_dir="/ck")  # fmt: skip
    cmd, env = steps.torchrun_command(p)
    assert cmd[5:] == ["-m", "deltarec.orchestrate.entry", "--", "team.train:main", "--export",
                       "/x"]  # fmt: skip
    assert env == {
        "DELTAREC_ARTIFACTS": "/a", "DELTAREC_RUN": "r", "DELTAREC_DUMP_EVERY_STEPS": "10",
        "DELTAREC_DUMP_EVERY_MINUTES": "2.5", "DELTAREC_STORE": "sqlite:///s.db",
        "DELTAREC_PUBLISH_MODE": "direct", "DELTAREC_STEPS": "50",
        "DELTAREC_CHECKPOINT_DIR": "/ck", "DELTAREC_DEVICE": "cpu",
    }  # fmt: skip


def test_entry_point_command_runs_as_is_under_torchrun():
    cmd, env = steps.torchrun_command(params(entry_point="python /opt/train.py --lr 0.1"))
    assert cmd[5:] == ["--no-python", "--", "python", "/opt/train.py", "--lr", "0.1"]
    assert env["DELTAREC_RUN"] == "r"


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"entry_point": "'unclosed"}, "entry_point"),
        ({"tables": "{not json"}, "tables is not JSON"),
        ({"tables": '{"a.t": {"dtype": "float32"}}'}, "tables['a.t']"),
        ({"webhook_url": "ftp://x"}, "not an http(s) URL"),
        ({"webhook_url": "https://hooks.example.com/x?token=abc"}, "query option 'token'"),
        ({"publish_mode": "eventual"}, "publish_mode"),
    ],
)
def test_bad_parameters_are_refused_naming_them(change, problem):
    with pytest.raises(ConfigError, match=re.escape(problem)):
        params(**change)


def test_parameters_survive_the_engines_string_rendering():
    p = params(dump_every_minutes=1.5, entry_point="t.m:f", tables='{"a.t": {"dim": 4}}')
    rendered = {k: v if isinstance(v, str) else str(float(v)) for k, v in p.arguments().items()}
    assert PipelineParams.from_arguments(rendered) == p
    with pytest.raises(ConfigError, match=r"steps: '2\.5' is not an integer"):
        PipelineParams.from_arguments({**rendered, "steps": "2.5"})


def test_generation_record_sums_rows_over_committed_dumps(tmp_path):
    gen = write_generation(tmp_path, "r", [(10, {"a": 5, "b": 2}), (20, {"a": 3})])
    record = steps.generation_record(steps.ArtifactRoot(str(tmp_path)), "r", gen)
    assert record == GenerationRecord("r", gen, 2, 20, 2, 10, record.uri)
    assert record.uri.endswith("r/gen-000001")


def test_generation_without_dumps_is_bad_input(tmp_path):
    gen = write_generation(tmp_path, "r", [])
    with pytest.raises(BadInputError, match=r"generation 1 .* has no committed dump"):
        steps.generation_record(steps.ArtifactRoot(str(tmp_path)), "r", gen)


def test_generation_record_round_trips_through_the_artifact_and_its_file(tmp_path):
    record = GenerationRecord("r", 3, 7, 700, 7, 1234, "file:///x/r/gen-000003")
    out = FakeArtifact(tmp_path / "gen" / "generation")
    steps.write_record(out, record)
    assert steps.read_record(out) == record
    assert json.loads((tmp_path / "gen" / "generation").read_text())["rows"] == 1234
    assert steps.read_record(FakeArtifact(out.path)) == record  # metadata lost: the file
    with pytest.raises(BadInputError, match="generation record"):
        steps.read_record(FakeArtifact(tmp_path / "missing"))


def test_verify_outcome_round_trips_through_the_report_artifact(tmp_path):
    outcome = steps.VerifyOutcome("FAIL", "r", 2, 5, {"passed": 0.0}, "t: 1 DIFFERENT", "/r")
    metrics, report = FakeArtifact(tmp_path / "m"), FakeArtifact(tmp_path / "rep")
    steps.log_outcome(outcome, metrics, report)
    assert metrics.metrics == {"passed": 0.0} and report.metadata["verdict"] == "FAIL"
    assert steps.read_outcome(report) == outcome
    with pytest.raises(BadInputError, match="carries no verify outcome"):
        steps.read_outcome(FakeArtifact(tmp_path / "other"))


def test_report_kfp_metrics_and_demo_summary_agree_on_the_freshness_p99(tmp_path):
    """For lags of 1..10 s the nearest-rank p99 is 10 s everywhere (interpolation said 9.91)."""
    from rich.console import Console

    from deltarec.demo import DemoResult, summary_table
    from deltarec.verify.report import freshness_svg
    from deltarec.verify.types import DumpFreshness, VerifyResult

    def dump(seq: int, lag: float) -> DumpFreshness:
        return DumpFreshness(
            generation=1, seq=seq, version=seq, kind="delta", created_at="2026-12-06T00:00:00Z",
            first_step=seq, last_step=seq, rows=10, age_s=1.0, live_rows=10, lag_s=lag,
        )  # fmt: skip

    dumps = [dump(i, float(lag)) for i, lag in enumerate([7, 2, 10, 1, 5, 9, 3, 8, 4, 6])]
    result = VerifyResult(
        run="r", generation=1, through_seq=9, version=9, store="sqlite:///s.db",
        mode="all", sample=None, seed=0, started_at="2026-12-06T00:00:00Z", dumps=dumps,
    )  # fmt: skip
    metrics = steps.outcome_of(result).metrics
    assert (metrics["freshness_p50_s"], metrics["freshness_p99_s"]) == (5.0, 10.0)
    svg = freshness_svg(dumps)
    assert "p50 5.00s" in svg and "p99 10.00s" in svg
    demo = DemoResult(
        workdir=str(tmp_path), store="sqlite:///s.db", generation=1, dumps=10, rows=100,
        evictions=0, keys_checked=100, freshness_p50_s=metrics.get("freshness_p50_s"),
        freshness_p99_s=metrics.get("freshness_p99_s"), verdict="PASS", promoted=1,
        report_path="r.html", log_path="l.log", seconds=1.0,
    )  # fmt: skip
    console = Console(width=120, record=True)
    console.print(summary_table(demo))
    summary = console.export_text()
    assert re.search(r"freshness p99\s+│ 10\.00 s", summary), summary
    assert re.search(r"freshness p50 \(training step → visible\)\s+│ 5\.00 s", summary), summary


@pytest.fixture
def created_jobs(tmp_path, monkeypatch):
    """A strict stand-in for the Training Operator's Kubernetes API, in namespace ``ml``.

    Records each PyTorchJob created; reading the job back writes a generation of run ``ctr``
    under ``tmp_path`` (what the job's ranks wrote) and reports the job Succeeded.
    """
    created = []

    class Api:
        def create_namespaced_custom_object(self, group, version, namespace, plural, body):
            created.append(body)
            return body

        def get_namespaced_custom_object(self, group, version, namespace, plural, name):
            write_generation(tmp_path, "ctr", [(100, {"t": 9})])
            return {"status": {"conditions": [{"type": "Succeeded", "status": "True"}]}}

    monkeypatch.setattr(pytorchjob, "kubernetes_api", lambda: Api())
    monkeypatch.setattr(pytorchjob, "current_namespace", lambda default="default": "ml")
    return created


def test_multi_node_train_creates_a_pytorchjob_and_reports_the_generation_it_wrote(
    tmp_path, created_jobs
):
    p = params(tmp_path, run_name="ctr", store_url="postgresql://u@db:5432/x", steps=100,
               ranks_per_node=4, nodes=2, gpus_per_node=4, launcher="pytorchjob")  # fmt: skip
    record = steps.train(p, job_id="kfp-run-1", secrets=["deltarec-credentials", "cloud", ""])
    (job,) = created_jobs
    assert job["metadata"]["namespace"] == "ml"
    assert job["metadata"]["name"] == pytorchjob.job_name("ctr", "kfp-run-1")
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert pod["args"][:2] == ["--device", "cuda"] and "postgresql://u@db:5432/x" in pod["args"]
    assert pod["command"][-2:] == ["deltarec", "train"]
    assert all("valueFrom" in e for e in pod["env"])  # credentials only, no settings
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    secrets = [e["valueFrom"]["secretKeyRef"]["name"] for e in worker["env"]]
    assert sorted(set(secrets)) == ["cloud", "deltarec-credentials"] and "envFrom" not in worker
    assert (record.generation, record.rows, record.last_step) == (1, 9, 100)


def test_multi_node_entry_point_pods_run_it_with_the_settings_as_environment(
    tmp_path, created_jobs
):
    p = params(tmp_path, run_name="ctr", nodes=3, entry_point="team.train:main",
               train_extra_args="--lr 0.1", launcher="pytorchjob")  # fmt: skip
    steps.train(p, job_id="j")
    pod = created_jobs[0]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
        "containers"
    ][0]
    assert pod["command"][-5:] == ["--", "python", "-m", "deltarec.orchestrate.entry",
                                   "team.train:main"]  # fmt: skip
    assert pod["args"] == ["--lr", "0.1"]
    env = {e["name"]: e["value"] for e in pod["env"]}
    assert env["DELTAREC_RUN"] == "ctr" and env["DELTAREC_ARTIFACTS"] == str(tmp_path)


def test_train_that_writes_no_generation_fails_the_step(tmp_path):
    with pytest.raises(StepFailedError, match=r"wrote no new generation of run 'r'"):
        steps.train(params(tmp_path), runner=lambda cmd, env: 0)


def test_failing_training_fails_the_train_step_with_its_exit_code(tmp_path):
    with pytest.raises(StepFailedError, match="step 'train' failed with exit code 3"):
        steps.train(params(tmp_path), runner=lambda cmd, env: 3)


def test_single_node_train_reports_the_generation_its_program_wrote(tmp_path):
    seen = []

    def runner(cmd, env):
        seen.append((list(cmd), dict(env)))
        write_generation(tmp_path, "r", [(5, {"t": 1})])
        return 0

    record = steps.train(params(tmp_path, entry_point="team.train:main"), runner=runner)
    assert record.generation == 1 and record.rows == 1
    ((cmd, env),) = seen
    assert "team.train:main" in cmd and env["DELTAREC_ARTIFACTS"] == str(tmp_path)


def test_provision_of_a_fresh_run_creates_the_declared_views_before_training(tmp_path):
    from deltarec.stores import open_store

    store = f"sqlite:///{tmp_path / 's.db'}"
    declared = params(tmp_path, store_url=store, entry_point="team.train:main",
                      tables='{"m.ebc.t_a": {"dim": 4}, "m.ebc.t_b": {"dim": 8}}')  # fmt: skip
    result = steps.provision(declared)
    assert result.generation is None and sorted(result.views) == ["m.ebc.t_a", "m.ebc.t_b"]
    with open_store(store) as s:
        assert {t: v.dim for t, v in s.views().items()} == {"m.ebc.t_a": 4, "m.ebc.t_b": 8}
    undeclared = params(tmp_path, store_url=store, entry_point="team.train:main")
    assert steps.provision(undeclared).views == {}
    example = steps.provision(params(tmp_path, store_url=f"sqlite:///{tmp_path / 'e.db'}"))
    assert "sparse.ebc.user_id" in example.views and "sparse.zch.ad_id" in example.views


def test_entry_point_loader_names_what_is_missing():
    from deltarec.orchestrate.entry import load_entry_point, main

    with pytest.raises(BadInputError, match=r"module 'no_such_team\.train' is not importable"):
        load_entry_point("no_such_team.train:main")
    with pytest.raises(BadInputError, match="has no callable 'nope'"):
        load_entry_point("json:nope")
    argv = sys.argv
    try:
        assert main(["--", "os:getcwd", "--", "x"]) == 0  # returns no int: exit code 0
        assert sys.argv == ["os", "x"]
    finally:
        sys.argv = argv


def test_every_pipeline_parameter_has_a_one_line_summary_for_the_engines_help():
    summaries = {name: PipelineParams.summary(name) for name in PipelineParams.names()}
    assert all(s.endswith(".") and "\n" not in s for s in summaries.values()), summaries
    assert summaries["run_name"] == "The run (lineage) name, ``[A-Za-z0-9_.-]``."
    assert summaries["store_url"].startswith("The online store, e.g. ``sqlite:///")
