"""End to end on this machine: ``deltarec pipeline run --local`` trains the example model on two
CPU ranks, publishes to SQLite, verifies every key and promotes; and ``deltarec demo``."""

import pathlib

import pytest

from deltarec.cli import main
from deltarec.demo import MARKER, prepare_workdir, summary_table
from deltarec.errors import BadInputError

from .conftest import run_pipeline_locally

pytestmark = pytest.mark.multiprocess


def test_pipeline_run_local_trains_publishes_verifies_and_promotes(tmp_path, capsys):
    store = f"sqlite:///{tmp_path / 'store.db'}"
    result, _ = run_pipeline_locally(
        tmp_path, capsys, "--run", "e2e", "--artifacts", str(tmp_path / "art"),
        "--store", store, "--steps", "30", "--dump-every-steps", "10", "--sample", "0",
        "--compact-min-dumps", "1", "--compact-partition-rows", "2500",
    )  # fmt: skip
    gen = result["generation"]
    assert result["verdict"] == "PASS" and result["promoted"] == gen["generation"] == 1
    assert gen["run"] == "e2e" and gen["last_step"] == 30 and gen["dumps"] >= 4
    assert gen["rows"] > 0 and gen["uri"].endswith("e2e/gen-000001")
    metrics = result["metrics"]
    assert metrics["passed"] == 1.0 and metrics["keys_checked"] > 0
    assert metrics["keys_different"] == metrics["keys_missing"] == 0.0
    report = pathlib.Path(result["report"]).read_text(encoding="utf-8")
    assert "<html" in report.lower() and "e2e" in report

    from deltarec.stores import open_store

    with open_store(store) as s:
        pointer = s.get_serving("e2e")
    assert (pointer.generation, pointer.seq) == (1, gen["last_seq"])
    # compacted before verify by a fan-out (the largest tables hold a few thousand rows: each is
    # cut into a few key ranges of about 2,500 rows, the other tables go together; a partition
    # runs as a step process of its own, so a smaller limit only adds processes), committed; gc
    # after promote deleted every dump the base covers but the newest
    from deltarec.artifacts import ArtifactRoot
    from deltarec.artifacts.base import list_bases

    root = ArtifactRoot(str(tmp_path / "art"))
    assert list_bases(root, "e2e") == [(1, gen["last_seq"])]
    assert root.committed_seqs("e2e", 1) == [gen["last_seq"]]
    assert any(p.name.startswith("compact-partition") for p in (tmp_path / "kfp").rglob("*"))
    # a later pipeline run's provision step provisions the newest generation's tables (idempotent)
    from deltarec.orchestrate import steps
    from deltarec.orchestrate.params import parse_params

    again = parse_params(run_name="e2e", artifact_root=str(tmp_path / "art"), store_url=store)
    for _ in range(2):
        assert steps.provision(again).generation == 1
    # the scheduled check of the chart verifies what serving now points at
    assert main(["pipeline", "verify-serving", "--artifacts", str(tmp_path / "art"),
                 "--run", "e2e", "--store", store, "--sample", "50"]) == 0  # fmt: skip


def test_demo_runs_the_pipeline_and_ends_with_a_summary_and_the_report(tmp_path, capsys):
    workdir = tmp_path / "demo"
    assert main(["demo", "--workdir", str(workdir), "--steps", "20"]) == 0
    printed = capsys.readouterr().out
    assert "PASS" in printed and "promoted generation" in printed
    report = workdir / "verify-report.html"
    assert f"HTML report: {report}" in printed
    assert report.read_text(encoding="utf-8").lstrip().startswith("<")
    assert (workdir / "store.db").exists() and (workdir / MARKER).exists()
    log = (workdir / "pipeline.log").read_text()
    assert "Executing task" in log and "train" in log


def test_demo_refuses_a_non_empty_workdir_it_did_not_create(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(BadInputError, match="not created by deltarec demo"):
        prepare_workdir(str(tmp_path))
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_demo_replaces_only_what_an_earlier_demo_left(tmp_path):
    prepare_workdir(str(tmp_path))
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "store.db").write_text("old")
    (tmp_path / "notes.txt").write_text("mine")
    prepare_workdir(str(tmp_path))
    assert not (tmp_path / "artifacts").exists() and not (tmp_path / "store.db").exists()
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_summary_table_names_every_number_of_the_demo(tmp_path):
    from rich.console import Console

    from deltarec.demo import DemoResult

    result = DemoResult(
        workdir=str(tmp_path), store="sqlite:///x.db", generation=1, dumps=7, rows=12345,
        evictions=17, keys_checked=999, freshness_p50_s=0.25, freshness_p99_s=1.5,
        verdict="PASS", promoted=1, report_path="r.html", log_path="l.log", seconds=61.0,
    )  # fmt: skip
    console = Console(record=True, width=120)
    console.print(summary_table(result))
    text = console.export_text()
    for expected in ("dumps", "7", "12,345", "17", "0.25 s", "1.50 s", "999", "PASS", "61.0 s"):
        assert expected in text
