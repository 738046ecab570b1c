"""The step entry points, without KFP: arguments they build, records they hand on, failures."""

import json
import pathlib

import pytest

from deltarec.errors import BadInputError
from deltarec.orchestrate import pytorchjob, steps
from deltarec.orchestrate.types import GenerationRecord, StepFailedError

from .conftest import FakeArtifact, write_generation


def test_train_args_carry_cadence_store_and_publish_mode_and_omit_what_is_off():
    args = steps.train_args(
        artifacts="/a",
        run="r",
        store="sqlite:///s.db",
        steps=50,
        dump_every_steps=10,
        dump_every_minutes=0,
        publish_mode="staged",
        checkpoint_dir="/c",
        extra_args=["--seed", "3"],
    )
    assert args == [
        "--artifacts",
        "/a",
        "--run",
        "r",
        "--steps",
        "50",
        "--dump-every-steps",
        "10",
        "--store",
        "sqlite:///s.db",
        "--publish-mode",
        "staged",
        "--workdir",
        "/c",
        "--seed",
        "3",
    ]
    no_store = steps.train_args(
        artifacts="/a",
        run="r",
        store="",
        steps=5,
        dump_every_steps=0,
        dump_every_minutes=0.5,
        publish_mode="direct",
    )
    assert no_store == [
        "--artifacts",
        "/a",
        "--run",
        "r",
        "--steps",
        "5",
        "--dump-every-minutes",
        "0.5",
    ]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"steps": 0}, "steps must be >= 1"),
        ({"publish_mode": "eventual"}, "publish mode 'eventual'"),
        ({"dump_every_steps": 0, "dump_every_minutes": 0}, "dump_every_steps or dump_every_min"),
    ],
)
def test_train_args_reject_bad_values_naming_them(change, message):
    kw = dict(
        artifacts="/a",
        run="r",
        store="",
        steps=5,
        dump_every_steps=1,
        dump_every_minutes=0,
        publish_mode="direct",
    )
    kw.update(change)
    with pytest.raises(BadInputError, match=message):
        steps.train_args(**kw)


def test_generation_record_sums_rows_over_committed_dumps(tmp_path):
    gen = write_generation(tmp_path, "r", [(10, {"a": 5, "b": 2}), (20, {"a": 3})])
    record = steps.generation_record(steps.ArtifactRoot(str(tmp_path)), "r", gen)
    assert record == GenerationRecord(
        run="r",
        generation=gen,
        last_seq=2,
        last_step=20,
        dumps=2,
        rows=10,
        uri=record.uri,
    )
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
    from_file = FakeArtifact(out.path)  # metadata lost: read the JSON file
    assert steps.read_record(from_file) == record
    with pytest.raises(BadInputError, match="generation record"):
        steps.read_record(FakeArtifact(tmp_path / "missing"))


def test_multi_node_train_creates_a_pytorchjob_and_reports_the_generation_it_wrote(
    tmp_path, monkeypatch
):
    created = []

    class Api:
        def create_namespaced_custom_object(self, group, version, namespace, plural, body):
            created.append(body)
            return body

        def get_namespaced_custom_object(self, group, version, namespace, plural, name):
            write_generation(tmp_path, "ctr", [(100, {"t": 9})])  # what the job's ranks wrote
            return {"status": {"conditions": [{"type": "Succeeded", "status": "True"}]}}

    monkeypatch.setattr(pytorchjob, "kubernetes_api", lambda: Api())
    monkeypatch.setattr(pytorchjob, "current_namespace", lambda default="default": "ml")
    out = FakeArtifact(tmp_path / "out" / "generation")
    record = steps.train(
        artifacts=str(tmp_path),
        run="ctr",
        store="postgresql://u@db:5432/x",
        steps=100,
        dump_every_steps=50,
        dump_every_minutes=0,
        publish_mode="direct",
        ranks_per_node=4,
        nodes=2,
        gpus_per_node=4,
        job_id="kfp-run-1",
        secrets="deltarec-credentials,cloud",
        output=out,
    )
    (job,) = created
    assert job["metadata"]["namespace"] == "ml"
    assert job["metadata"]["name"] == pytorchjob.job_name("ctr", "kfp-run-1")
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    args = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["args"]
    assert args[:2] == ["--device", "cuda"] and "postgresql://u@db:5432/x" in args
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert [e["secretRef"]["name"] for e in pod["envFrom"]] == ["deltarec-credentials", "cloud"]
    assert (record.generation, record.rows, record.last_step) == (1, 9, 100)
    assert out.metadata["generation"] == 1 and out.metadata["run"] == "ctr"


def test_train_that_writes_no_generation_fails_the_step(tmp_path, monkeypatch):
    monkeypatch.setattr(steps, "run_cli", lambda step, argv: 0)
    with pytest.raises(StepFailedError, match="wrote no new generation of run 'r'"):
        steps.train(
            artifacts=str(tmp_path),
            run="r",
            store="",
            steps=5,
            dump_every_steps=1,
            dump_every_minutes=0,
            publish_mode="direct",
            ranks_per_node=2,
        )


def test_single_node_train_runs_deltarec_train_under_torchrun_with_its_device(
    tmp_path, monkeypatch
):
    seen = []

    def fake_cli(step, argv):
        seen.append(list(argv))
        write_generation(tmp_path, "r", [(5, {"t": 1})])
        return 0

    monkeypatch.setattr(steps, "run_cli", fake_cli)
    steps.train(
        artifacts=str(tmp_path), run="r", store="", steps=5, dump_every_steps=1,
        dump_every_minutes=0, publish_mode="direct", ranks_per_node=2, gpus_per_node=1,
    )  # fmt: skip
    (argv,) = seen
    assert argv[:5] == ["train", "--nproc-per-node", "2", "--device", "cuda"]
    assert argv[5:9] == ["--artifacts", str(tmp_path), "--run", "r"]


def test_failing_training_fails_the_train_step_with_its_exit_code(tmp_path, monkeypatch):
    monkeypatch.setattr(steps, "run_cli", lambda step, argv: 1)
    with pytest.raises(StepFailedError, match="step 'train' failed with exit code 1"):
        steps.train(
            artifacts=str(tmp_path), run="r", store="", steps=5, dump_every_steps=1,
            dump_every_minutes=0, publish_mode="direct", ranks_per_node=2,
        )  # fmt: skip


def test_freshness_percentiles_come_from_the_dumps_publish_lag():
    summary = {"dumps": [{"lag_s": x} for x in (4.0, 1.0, 3.0, 2.0, None)] + [{"seq": 9}]}
    got = steps.freshness_percentiles(summary)
    assert got["freshness_p50_s"] == pytest.approx(2.5)
    assert got["freshness_p99_s"] == pytest.approx(3.97)
    assert steps.freshness_percentiles({"dumps": [{"lag_s": None}]}) == {}


def test_numeric_summary_flattens_numbers_and_skips_lists():
    got = steps.numeric_summary({"totals": {"MATCH": 9, "ok": False}, "tables": [1], "x": "s"})
    assert got == {"totals.MATCH": 9.0, "totals.ok": 0.0}


def test_a_failing_command_names_the_step_and_exit_code(monkeypatch):
    import deltarec.cli

    monkeypatch.setattr(deltarec.cli, "main", lambda argv: 2)
    with pytest.raises(StepFailedError, match="step 'promote' failed with exit code 2"):
        steps.promote(
            artifacts="/a",
            store="sqlite:///x.db",
            generation=FakeArtifact("/x", GenerationRecord("r", 1, 1, 1, 1, 1, "u").to_metadata()),
        )


def test_verify_that_stops_without_a_result_fails_the_step_instead_of_reading_as_fail(
    monkeypatch,
):
    import deltarec.cli

    monkeypatch.setattr(deltarec.cli, "main", lambda argv: 1)  # e.g. the store is down
    gen = FakeArtifact("/x", GenerationRecord("r", 1, 1, 1, 1, 1, "u").to_metadata())
    with pytest.raises(StepFailedError, match="verify stopped before it had a result"):
        steps.verify(artifacts="/a", store="sqlite:///x.db", generation=gen, sample_size=5)


def test_verify_mismatch_is_a_fail_verdict_with_metrics(tmp_path, monkeypatch):
    import deltarec.cli

    def fake_main(argv):
        doc = {"passed": False, "totals": {"checked": 4, "DIFFERENT": 1}}
        pathlib.Path(argv[argv.index("--json") + 1]).write_text(json.dumps(doc))
        pathlib.Path(argv[argv.index("--metrics") + 1]).write_text('{"keys_different": 1}')
        return 1

    monkeypatch.setattr(deltarec.cli, "main", fake_main)
    gen = FakeArtifact("/x", GenerationRecord("r", 1, 3, 30, 3, 9, "u").to_metadata())
    metrics = FakeArtifact(tmp_path / "m")
    report = FakeArtifact(tmp_path / "r" / "report")
    verdict = steps.verify(
        artifacts="/a", store="sqlite:///x.db", generation=gen, sample_size=0,
        metrics=metrics, report=report,
    )  # fmt: skip
    assert verdict == "FAIL"
    assert metrics.metrics == {"keys_different": 1.0, "passed": 0.0}
    assert report.metadata["verdict"] == "FAIL" and report.metadata["generation"] == 1
