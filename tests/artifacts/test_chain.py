"""The chain of dumps (SPEC §3a): every reader refuses a generation with a missing dump."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from tests._helpers.artifacts import new_keyed_generation, write_keyed_dump

from deltarec.artifacts import ArtifactRoot, DumpKind, Parent
from deltarec.artifacts.base import BaseInfo, LineageEntry
from deltarec.artifacts.lineage import expected_state, keys_published_after
from deltarec.cli import main
from deltarec.errors import MissingDumpError
from deltarec.serving.follow import FixedPointer, Follower, FollowOptions
from deltarec.serving.replica import Replica
from deltarec.stores.types import ServingPointer

RUN = "ctr"


def _seven_dumps(tmp_path) -> tuple[ArtifactRoot, int, str]:
    root = ArtifactRoot(str(tmp_path / "art"))
    g = new_keyed_generation(root, RUN)
    write_keyed_dump(root, RUN, g, 0, list(range(20)), 0, kind=DumpKind.SNAPSHOT)
    for seq in range(1, 7):
        write_keyed_dump(root, RUN, g, seq, [seq, seq + 20], seq * 10)
    return root, g, f"sqlite:///{tmp_path / 'store.db'}"


def _commit_base(root: ArtifactRoot, generation: int, through: int, lineage=None) -> None:
    """A BASE.json without parts: enough for the chain, which reads only names and lineage."""
    info = BaseInfo(
        run=RUN,
        generation=generation,
        through_seq=through,
        lineage=tuple(lineage or [LineageEntry(generation, through, None)]),
        tables={},
        rows={},
        parts=(),
    )
    data = json.dumps(info.to_json()).encode()
    root.write_bytes_atomic(root.base_file(RUN, generation, through), data)


def test_a_dump_deleted_from_the_middle_is_refused_by_every_command(tmp_path, capsys):
    root, g, url = _seven_dumps(tmp_path)
    loc = ["--artifacts", root.uri, "--run", RUN]
    assert main(["publish", *loc, "--store", url]) == 0
    assert main(["verify", *loc, "--store", url, "--all"]) == 0
    assert main(["promote", *loc, "--store", url, "--generation", str(g)]) == 0
    shutil.rmtree(root.dump_dir(RUN, g, 3))
    capsys.readouterr()
    for argv in (
        ["publish", *loc, "--store", url],
        ["verify", *loc, "--store", url, "--all"],
        ["verify", *loc, "--store", url],
        ["promote", *loc, "--store", url, "--generation", str(g)],
        ["rollback", *loc, "--store", url, "--to-generation", str(g)],
        ["inspect", *loc],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"run '{RUN}' generation {g}: dump 3 is missing" in err, (argv, err)
        assert "committed: 0-2, 4-6" in err


def test_a_replica_and_a_restore_refuse_a_generation_with_a_missing_dump(tmp_path):
    root, g, _ = _seven_dumps(tmp_path)
    shutil.rmtree(root.dump_dir(RUN, g, 3))
    follower = Follower(
        Replica(root, RUN), FixedPointer(ServingPointer(RUN, g, 6, 1.0)), FollowOptions()
    )
    follower.poll()
    assert not follower.status().ready and "dump 3 is missing" in follower.status().blocked
    with pytest.raises(MissingDumpError, match="dump 3 is missing") as e:
        keys_published_after(root, RUN, Parent(g, 30))
    assert (e.value.run, e.value.generation, e.value.seq) == (RUN, g, 3)


def test_a_delta_only_generation_may_start_at_one_but_not_later(tmp_path):
    root = ArtifactRoot(str(tmp_path / "art"))
    g = new_keyed_generation(root, RUN)
    write_keyed_dump(root, RUN, g, 1, [1], 1)
    write_keyed_dump(root, RUN, g, 2, [2], 2)
    assert root.list_dumps(RUN, g) == [1, 2]
    shutil.rmtree(root.dump_dir(RUN, g, 1))
    with pytest.raises(MissingDumpError, match="dump 1 is missing"):
        root.list_dumps(RUN, g)
    assert root.committed_seqs(RUN, g) == [2]


def test_dumps_a_committed_base_covers_may_be_gone(tmp_path):
    root, g, _ = _seven_dumps(tmp_path)
    for seq in (0, 1, 2, 3):
        shutil.rmtree(root.dump_dir(RUN, g, seq))
    with pytest.raises(MissingDumpError, match="dump 1 is missing"):
        root.list_dumps(RUN, g)
    _commit_base(root, g, 2)  # covers 0..2 only: 3 is still missing
    with pytest.raises(MissingDumpError, match=r"dump 3 is missing.*after base through dump 2"):
        root.list_dumps(RUN, g)
    _commit_base(root, g, 3)
    assert root.list_dumps(RUN, g) == [4, 5, 6]
    shutil.rmtree(root.dump_dir(RUN, g, 5))  # after the base: missing
    with pytest.raises(MissingDumpError, match="dump 5 is missing"):
        root.list_dumps(RUN, g)


def test_a_base_without_base_json_covers_nothing(tmp_path):
    root, g, _ = _seven_dumps(tmp_path)
    shutil.rmtree(root.dump_dir(RUN, g, 1))
    _commit_base(root, g, 3)
    base_json = root.base_file(RUN, g, 3)
    shutil.move(base_json, base_json + ".gone")
    with pytest.raises(MissingDumpError, match="dump 1 is missing"):
        expected_state(root, RUN, g)


def test_a_childs_base_covers_its_parent_through_its_lineage(tmp_path):
    root, g, _ = _seven_dumps(tmp_path)
    child = new_keyed_generation(root, RUN, parent=Parent(g, 40))
    write_keyed_dump(root, RUN, child, 1, [1], 41)
    shutil.rmtree(root.dump_dir(RUN, g, 2))
    with pytest.raises(MissingDumpError, match=f"generation {g}: dump 2 is missing"):
        expected_state(root, RUN, child)
    _commit_base(root, child, 1, [LineageEntry(g, 4, 40), LineageEntry(child, 1, None)])
    assert root.list_dumps(RUN, g) == [0, 1, 3, 4, 5, 6]
    assert np.array_equal(root.list_dumps(RUN, child), [1])
