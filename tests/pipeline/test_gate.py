"""verify gates promote in a real kfp.local run of the pipeline.

The step subprocesses get a fast fake at the CLI boundary (fake_steps/sitecustomize.py), so a
run takes seconds; the real end-to-end run is in test_local_run.py.
"""

import json
import pathlib

import pytest

from deltarec.cli import main
from deltarec.orchestrate.local import run_local
from deltarec.orchestrate.params import parse_params

FAKES = pathlib.Path(__file__).parent / "fake_steps"


@pytest.fixture
def fake_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(FAKES))
    monkeypatch.setenv("FAKE_PROMOTE_LOG", str(tmp_path / "promoted.txt"))
    return tmp_path / "promoted.txt"


def params(tmp_path):
    return parse_params(
        run_name="gate", artifact_root=str(tmp_path / "art"), store_url="sqlite:///unused.db",
        steps=20, dump_every_steps=10, sample_size=0,
    )  # fmt: skip


def test_failed_verify_skips_promote_and_run_local_exits_1(tmp_path, fake_steps, monkeypatch):
    monkeypatch.setenv("FAKE_VERIFY_CODE", "1")
    out = tmp_path / "result.json"
    code = main([
        "pipeline", "run", "--local", "--run", "gate", "--artifacts", str(tmp_path / "art"),
        "--store", "sqlite:///unused.db", "--steps", "20", "--pipeline-root", str(tmp_path / "k"),
        "--json", str(out),
    ])  # fmt: skip
    result = json.loads(out.read_text())
    assert code == 1 and result["verdict"] == "FAIL" and result["promoted"] is None
    assert result["metrics"]["passed"] == 0.0
    assert not fake_steps.exists()  # promote never ran


def test_passed_verify_promotes_the_generation_train_produced(tmp_path, fake_steps, monkeypatch):
    monkeypatch.setenv("FAKE_VERIFY_CODE", "0")
    result = run_local(params(tmp_path), pipeline_root=str(tmp_path / "kfp"))
    assert result.verdict == "PASS" and result.promoted == 1
    assert (result.generation.dumps, result.generation.rows, result.generation.last_seq) == (
        2,
        6,
        2,
    )
    assert pathlib.Path(result.report_path).read_text() == "<html>fake verify</html>"
    assert result.metrics["freshness_p50_s"] == 1.0 and result.metrics["passed"] == 1.0
    (line,) = fake_steps.read_text().splitlines()
    assert line.endswith("--run gate --store sqlite:///unused.db --generation 1 --through-seq 2")
