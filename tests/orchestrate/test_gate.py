"""verify gates promote in a real kfp.local run of the pipeline; a FAIL runs the FAIL branch.

The step subprocesses get fast fakes of the typed train, verify and promote functions
(fake_steps/sitecustomize.py), so a run takes seconds; the real end-to-end runs are in
test_local_run.py and test_verify_failure.py.
"""

import logging
import os
import pathlib

import pytest

from deltarec.orchestrate.local import run_local
from deltarec.orchestrate.params import parse_params

from .conftest import run_pipeline_locally

FAKES = pathlib.Path(__file__).parent / "fake_steps"


@pytest.fixture
def fake_steps(tmp_path, monkeypatch):
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(FAKES), os.environ.get("PYTHONPATH", "")])
    )
    monkeypatch.setenv("FAKE_PROMOTE_LOG", str(tmp_path / "promoted.txt"))
    return tmp_path / "promoted.txt"


def params(tmp_path, **change):
    return parse_params(**{**dict(
        run_name="gate", artifact_root=str(tmp_path / "art"),
        store_url=f"sqlite:///{tmp_path / 'store.db'}", steps=20, dump_every_steps=10,
        sample_size=0, entry_point="gate_team.train:main",
    ), **change})  # fmt: skip


def test_failed_verify_skips_promote_runs_the_fail_branch_and_exits_1(
    tmp_path, fake_steps, monkeypatch, capsys
):
    monkeypatch.setenv("FAKE_VERDICT", "FAIL")
    result, printed = run_pipeline_locally(
        tmp_path, capsys, "--run", "gate", "--artifacts", str(tmp_path / "art"),
        "--store", f"sqlite:///{tmp_path / 'store.db'}", "--steps", "20", expect=1,
    )  # fmt: skip
    assert result["verdict"] == "FAIL" and result["promoted"] is None
    assert result["metrics"]["passed"] == 0.0
    assert "verify-failed" in result["failure"]
    assert pathlib.Path(result["report"]).read_text() == "<html>fake verify</html>"
    assert not fake_steps.exists()  # promote never ran
    assert "nothing-to-undo" in printed  # the FAIL branch's own log line


def test_passed_verify_promotes_the_generation_train_produced(tmp_path, fake_steps, monkeypatch):
    monkeypatch.setenv("FAKE_VERDICT", "PASS")
    # verify fans out over 3 partitions (dsl.ParallelFor); the gate checks it got all three
    result = run_local(params(tmp_path, verify_partitions=3), pipeline_root=str(tmp_path / "kfp"))
    assert result.verdict == "PASS" and result.promoted == 1 and result.failure == ""
    assert (result.generation.dumps, result.generation.rows, result.generation.last_seq) == (
        2,
        6,
        2,
    )
    assert pathlib.Path(result.report_path).read_text() == "<html>fake verify</html>"
    assert result.metrics["freshness_p50_s"] == 1.0 and result.metrics["passed"] == 1.0
    (line,) = fake_steps.read_text().splitlines()
    assert line == f"gate 1 2 sqlite:///{tmp_path / 'store.db'}"
    from deltarec.artifacts import ArtifactRoot
    from deltarec.artifacts.base import list_bases

    # 2 dumps, fewer than compact_min_dumps (50): the compact task skipped, gc found nothing
    root = ArtifactRoot(str(tmp_path / "art"))
    assert list_bases(root, "gate") == [] and root.committed_seqs("gate", 1) == [1, 2]


def test_a_large_table_is_compacted_by_a_fan_out_before_verify_and_gc_follows_promote(
    tmp_path, fake_steps, monkeypatch
):
    from deltarec.artifacts import ArtifactRoot
    from deltarec.artifacts.base import list_bases, read_base

    monkeypatch.setenv("FAKE_VERDICT", "PASS")
    # two dumps of 3 rows: an estimate of 6 rows, cut into 3 key ranges of 2 (dsl.ParallelFor)
    p = params(tmp_path, compact_min_dumps=1, compact_partition_rows=2)
    handlers = logging.getLogger().handlers[:]
    result = run_local(p, pipeline_root=str(tmp_path / "kfp"))
    assert result.verdict == "PASS" and result.promoted == 1
    # the caller's logging as it was (kfp.local's fan-out left its stdout handler behind)
    assert logging.getLogger().handlers == handlers
    root = ArtifactRoot(str(tmp_path / "art"))
    assert list_bases(root, "gate") == [(1, 2)]
    base = read_base(root, "gate", 1, 2)
    assert base.rows == {"sparse.t": 3} and [p.path for p in base.parts] == [
        "sparse.t/part-00000.parquet"
    ]
    tasks = sorted(p.name for p in (tmp_path / "kfp").rglob("*") if p.is_dir())
    assert any(t.startswith("compact-partition") for t in tasks), tasks
    # gc ran after promote: dump 1 is covered by the base and nothing needs it
    assert root.committed_seqs("gate", 1) == [2]
