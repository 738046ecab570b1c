"""RunHistory: a command reads each listing, existence check and record of the root once."""

from __future__ import annotations

import shutil

import pytest
from tests._helpers.artifacts import new_keyed_generation, write_keyed_dump

from deltarec.artifacts import ArtifactRoot, DumpKind
from deltarec.artifacts.history import RunHistory
from deltarec.artifacts.lineage import expected_state
from deltarec.errors import MissingDumpError

RUN = "ctr"


def _root(tmp_path, dumps=20) -> tuple[ArtifactRoot, int]:
    root = ArtifactRoot(str(tmp_path / "art"))
    g = new_keyed_generation(root, RUN)
    write_keyed_dump(root, RUN, g, 0, list(range(30)), 0, kind=DumpKind.SNAPSHOT)
    for seq in range(1, dumps):
        write_keyed_dump(root, RUN, g, seq, [seq], seq)
    return root, g


def test_a_second_walk_of_the_history_reads_nothing_from_the_root(tmp_path):
    root, g = _root(tmp_path)
    h = RunHistory(root)
    first = expected_state(h, RUN, g)
    reads = h.reads
    assert reads >= 20  # the listing, each manifest's existence and each manifest
    again = expected_state(h, RUN, g)
    assert h.reads == reads
    assert (first.tables["sparse.ebc.t"].keys == again.tables["sparse.ebc.t"].keys).all()
    assert h.read_manifest(RUN, g, 3) is h.read_manifest(RUN, g, 3)


def test_what_the_command_writes_through_it_is_read_again(tmp_path):
    root, g = _root(tmp_path, dumps=3)
    h = RunHistory(root)
    assert h.list_dumps(RUN, g) == [0, 1, 2]
    write_keyed_dump(h, RUN, g, 3, [3], 3)  # commits through h: forgets what it read
    assert h.list_dumps(RUN, g) == [0, 1, 2, 3]


def test_the_chain_is_checked_through_it_and_forget_reads_again(tmp_path):
    root, g = _root(tmp_path, dumps=6)
    h = RunHistory(root)
    assert h.list_dumps(RUN, g) == list(range(6))
    shutil.rmtree(root.dump_dir(RUN, g, 2))  # outside the command: not seen until forgotten
    assert h.list_dumps(RUN, g) == list(range(6))
    h.forget()
    with pytest.raises(MissingDumpError, match="dump 2 is missing"):
        h.list_dumps(RUN, g)
    assert RunHistory.of(h) is h
