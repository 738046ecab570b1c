"""The TrainJob path end to end through the Kubeflow SDK's local process backend.

``deltarec pipeline run --local --nodes 2`` runs the ``train-launcher`` step, which hands the
TrainJob to a real ``kubeflow.trainer.TrainerClient`` (``LocalProcessBackendConfig``): the SDK
makes its venv, pip-installs the job's packages offline, and its torchrun runs deltarec's
training on two CPU processes; then verify reads every key back and promote moves serving.
"""

import json

import pytest

from deltarec.errors import BadInputError
from deltarec.orchestrate.pytorchjob import TrainJobSpec
from deltarec.orchestrate.trainjob_local import run_local_train_job
from deltarec.orchestrate.types import TrainJobFailedError

from .conftest import run_pipeline_locally

pytest.importorskip("kubeflow.trainer")

# real torchrun ranks (multiprocess) in a venv the SDK creates and pip-installs (integration)
pytestmark = [pytest.mark.multiprocess, pytest.mark.integration]


def test_two_node_pipeline_trains_through_the_sdk_local_backend_then_verifies_and_promotes(
    tmp_path, capsys, monkeypatch
):
    jobs_tmp = tmp_path / "tmp"
    jobs_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(jobs_tmp))  # where the SDK makes the job's venv
    # relative paths: the SDK starts the job in its venv (and chdirs this process there)
    monkeypatch.chdir(tmp_path)
    store = "sqlite:///store.db"
    art = tmp_path / "art"
    result, printed = run_pipeline_locally(
        tmp_path, capsys, "--run", "tj", "--artifacts", "art", "--store", store,
        "--steps", "30", "--dump-every-steps", "10", "--sample", "0",
        "--nodes", "2", "--ranks-per-node", "1",
    )  # fmt: skip
    gen = result["generation"]
    assert result["verdict"] == "PASS" and result["promoted"] == gen["generation"] == 1
    assert gen["last_step"] == 30 and gen["dumps"] >= 3 and gen["rows"] > 0
    metrics = result["metrics"]
    assert metrics["keys_checked"] > 0 and metrics["keys_different"] == 0.0
    assert metrics["keys_missing"] == 0.0
    # both processes trained one world: every dump holds a shard of each of the 2 ranks
    info = json.loads((art / "tj" / "gen-000001" / "GENERATION.json").read_text())
    assert info["world_size"] == 2
    manifest = json.loads(
        (art / "tj" / "gen-000001" / f"dump-{gen['last_seq']:06d}" / "MANIFEST.json").read_text()
    )
    assert manifest["last_step"] == 30
    # the launcher step ran it through the SDK (its job log), the one-node train task did not
    assert "2 processes through the local process backend" in printed
    assert "-train] Completed with code 0" in printed
    run_dir = next(p for p in (tmp_path / "kfp").iterdir() if p.is_dir())
    assert (run_dir / "train-launcher").is_dir() and not (run_dir / "train").exists()
    from deltarec.stores import open_store

    with open_store(store) as s:
        pointer = s.get_serving("tj")
    assert (pointer.generation, pointer.seq) == (1, gen["last_seq"])
    # the job's venv, wheel and torchrun logs are gone (kfp.local's component scripts and
    # torch's compile cache are not the job's)
    left = [p.name for p in jobs_tmp.iterdir() if not p.name.startswith(("tmp.", "torchinductor"))]
    assert left == []


def test_a_failing_local_train_job_fails_with_its_last_output(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    spec = TrainJobSpec(
        name="tj-fails", namespace="local", image="local", nodes=2, procs_per_node=1,
        gpus_per_node=0, train_args=("-c", 'echo "rank $RANK gave up" >&2; exit $((3 + RANK))'),
        program=("sh",), timeout_s=120,
    )  # fmt: skip
    with pytest.raises(TrainJobFailedError) as e:
        run_local_train_job(spec, poll_s=0.5)
    message = str(e.value)
    assert message.startswith("TrainJob local/tj-fails: Failed: rank "), message
    # torchrun's root cause: the rank that failed first, its exit code and its last line
    rank = int(message.split("rank ")[1].split()[0])
    assert f"rank {rank} exit code {3 + rank}; last output: rank {rank} gave up" in message
    assert list(tmp_path.iterdir()) == []  # the failed job's venv is removed too


def test_a_local_run_refuses_several_nodes_through_a_pytorchjob(tmp_path):
    from deltarec.orchestrate.params import parse_params
    from deltarec.orchestrate.trainjob_local import check_launcher

    params = parse_params(
        run_name="r", artifact_root=str(tmp_path), store_url="sqlite:///x.db", nodes=2,
        launcher="pytorchjob",
    )  # fmt: skip
    with pytest.raises(BadInputError, match="launcher=pytorchjob needs a cluster"):
        check_launcher(params)
    check_launcher(parse_params(
        run_name="r", artifact_root=str(tmp_path), store_url="sqlite:///x.db", nodes=2,
    ))  # fmt: skip
