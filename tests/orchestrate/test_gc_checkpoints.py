"""The pipeline's gc step keeps every checkpoint under ``checkpoint_dir`` restorable (SPEC §3a).

The artifacts are written with the compaction tests' helper (eight dumps of ten steps each);
the checkpoints are written in the trainer's format (DCP files holding rank 0's packed hook
states, then the ``COMPLETE`` marker), with and without the marker's ``lineage``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch.distributed.checkpoint as dcp
from tests.artifacts.test_compact import RUN, History
from tests.artifacts.test_retention import _eight, _published, _verify_all

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.base import list_bases
from deltarec.artifacts.compact import compact
from deltarec.artifacts.lineage import expected_state
from deltarec.cli import main
from deltarec.dump.dumper import STATE_VERSION
from deltarec.orchestrate.history_steps import retain
from deltarec.orchestrate.params import parse_params
from deltarec.promote.retain import CheckpointDirError
from deltarec.train import checkpoint
from deltarec.train.checkpoint_info import complete_marker, read_checkpoints

STEP = 40  # the end of dump 3 of generation 1 (each dump is ten steps)
HOOK = "deltarec.dump.hook.DumpTrainHook#0"


def _write_checkpoint(workdir: Path, step: int, generation: int | None, lineage: bool) -> Path:
    """A checkpoint as the trainer writes it; ``lineage=False``: a marker of older versions."""
    path = workdir / "checkpoints" / f"step-{step:08d}"
    dumper = {"version": STATE_VERSION, "run": RUN, "generation": generation, "seq": 3,
              "step": step, "last_dump_step": step}  # fmt: skip
    states = {HOOK: dumper}
    dcp.save({"hooks": {"rank-00000": checkpoint._pack_hooks(states)}}, checkpoint_id=str(path),
             no_dist=True)  # fmt: skip
    marker = complete_marker(step, 2, states)
    if not lineage:
        del marker["lineage"]
    (path / "COMPLETE").write_text(json.dumps(marker))
    return path


def _replay(root: ArtifactRoot, generation: int, seq: int) -> dict[str, tuple]:
    state = expected_state(root, RUN, generation, seq)
    out = {}
    for table, et in state.tables.items():
        keys = et.present_keys()
        out[table] = (keys, et.load(keys))
    return out


@pytest.fixture
def h(tmp_path) -> History:
    return History(ArtifactRoot(str(tmp_path / "art")))


def _run_with_two_bases(tmp_path, h) -> str:
    _eight(h)
    url = _published(tmp_path, h)
    compact(h.root, RUN, through_seq=3)
    compact(h.root, RUN, through_seq=7)
    return url


def _params(h, url: str, checkpoint_dir: str = ""):
    return parse_params(run_name=RUN, artifact_root=h.root.uri, store_url=url,
                        checkpoint_dir=checkpoint_dir)  # fmt: skip


@pytest.mark.parametrize("lineage", [True, False], ids=["marker", "older-marker"])
def test_pipeline_gc_keeps_what_a_restore_from_an_older_checkpoint_reads(tmp_path, h, lineage):
    url = _run_with_two_bases(tmp_path, h)
    workdir = tmp_path / "work"
    _write_checkpoint(workdir, STEP, 1, lineage)
    before = _replay(h.root, 1, 3)
    out = retain(_params(h, url, str(workdir)))
    assert out["mode"] == "delete" and out["checkpoints"] == [[1, STEP]]
    why = f"a restore from checkpoint generation 1 step {STEP} reads it"
    kept = {p["path"].rsplit("/", 1)[-1]: p for p in out["paths"] if not p["delete"]}
    assert all(kept[f"dump-{s:06d}"]["reason"] == why for s in range(4, 7))
    assert h.root.committed_seqs(RUN, 1) == [4, 5, 6, 7]
    assert list_bases(h.root, RUN) == [(1, 3), (1, 7)]
    after = _replay(h.root, 1, 3)  # the restore point replays as before
    assert after.keys() == before.keys()
    for table, (keys, rows) in before.items():
        assert np.array_equal(after[table][0], keys) and np.array_equal(after[table][1], rows)
    assert _verify_all(tmp_path, h, url)


def test_pipeline_gc_without_a_checkpoint_dir_deletes_what_only_the_checkpoint_needed(tmp_path, h):
    url = _run_with_two_bases(tmp_path, h)
    out = retain(_params(h, url))
    assert out["checkpoints"] == []
    assert h.root.committed_seqs(RUN, 1) == [7]


def test_a_checkpoint_saved_before_the_dumper_started_or_of_another_run_needs_nothing(tmp_path, h):
    url = _run_with_two_bases(tmp_path, h)
    workdir = tmp_path / "work"
    _write_checkpoint(workdir, STEP, None, lineage=True)
    other = workdir / "checkpoints" / f"step-{50:08d}"
    _write_checkpoint(workdir, 50, 1, lineage=True)
    marker = json.loads((other / "COMPLETE").read_text())
    marker["lineage"] = [{"run": "another", "generation": 1}]
    (other / "COMPLETE").write_text(json.dumps(marker))
    assert [c.lineage for c in read_checkpoints(str(workdir))] == [(), (("another", 1),)]
    assert retain(_params(h, url, str(workdir)))["checkpoints"] == []
    assert h.root.committed_seqs(RUN, 1) == [7]


@pytest.mark.parametrize("damage", ["missing", "marker"])
def test_an_unreadable_checkpoint_dir_makes_gc_delete_nothing(tmp_path, h, capsys, damage):
    url = _run_with_two_bases(tmp_path, h)
    workdir = tmp_path / "work"
    if damage == "marker":
        path = _write_checkpoint(workdir, STEP, 1, lineage=True)
        (path / "COMPLETE").write_text("{not json")
    with pytest.raises(CheckpointDirError, match=f"gc deletes nothing: .*{workdir}"):
        retain(_params(h, url, str(workdir)))
    assert h.root.committed_seqs(RUN, 1) == list(range(8))
    argv = ["gc", "--artifacts", h.root.uri, "--run", RUN, "--store", url]
    capsys.readouterr()
    assert main([*argv, "--checkpoints-from", str(workdir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(workdir) in err[0] and "deletes nothing" in err[0]
    assert h.root.committed_seqs(RUN, 1) == list(range(8))


def test_cli_gc_finds_the_checkpoints_under_the_trainers_workdir(tmp_path, h, capsys):
    url = _run_with_two_bases(tmp_path, h)
    workdir = tmp_path / "work"
    _write_checkpoint(workdir, STEP, 1, lineage=False)
    argv = ["gc", "--artifacts", h.root.uri, "--run", RUN, "--store", url, "--json"]
    capsys.readouterr()
    assert main([*argv, "--checkpoints-from", str(workdir), "--dry-run"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["checkpoints"] == [{"generation": 1, "step": STEP}]
    assert main([*argv, "--checkpoints-from", str(workdir)]) == 0
    assert h.root.committed_seqs(RUN, 1) == [4, 5, 6, 7]


def test_gc_keeps_the_checkpoints_of_a_workdir_given_in_the_example_trainers_extra_arguments():
    from deltarec.orchestrate.history_steps import checkpoint_dirs

    _REQUIRED = {"run_name": RUN, "artifact_root": "/a", "store_url": "sqlite:////s.db"}

    params = parse_params(
        **_REQUIRED, checkpoint_dir="/ckpt/a", train_extra_args="--batch-size 8 --workdir /ckpt/b"
    )
    assert checkpoint_dirs(params) == ["/ckpt/a", "/ckpt/b"]
    assert checkpoint_dirs(parse_params(**_REQUIRED, train_extra_args="--workdir=/ckpt/c")) == [
        "/ckpt/c"
    ]
    own = parse_params(**_REQUIRED, entry_point="team.train:main", train_extra_args="--workdir /x")
    assert checkpoint_dirs(own) == []  # an entry point's arguments mean what it says they mean
