"""Retention (SPEC §3a): deltarec gc deletes what a base covers and nothing needs.

One test for each reason a dump or base stays."""

from __future__ import annotations

import json
import os

import pytest
from tests.artifacts.test_compact import RUN, History

from deltarec.artifacts import ArtifactRoot, DumpKind, Parent
from deltarec.artifacts.base import list_bases
from deltarec.artifacts.compact import compact
from deltarec.artifacts.lease import RunLease
from deltarec.artifacts.lineage import expected_state
from deltarec.cli import main


@pytest.fixture
def h(tmp_path) -> History:
    return History(ArtifactRoot(str(tmp_path / "art")))


def _gc(h, urls, *extra, capsys) -> dict[tuple[str, int, int], tuple[bool, str]]:
    argv = ["gc", "--artifacts", h.root.uri, "--run", RUN, "--json", *extra]
    for url in urls:
        argv += ["--store", url]
    capsys.readouterr()
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    table = {}
    for row in out["paths"]:
        name = os.path.basename(row["path"])
        parts = name.split("-")
        if row["kind"] == "dump":
            g = int(os.path.basename(os.path.dirname(row["path"])).split("-")[1])
            key = ("dump", g, int(parts[1]))
        else:
            key = ("base", int(parts[1]), int(parts[2]))
        table[key] = (row["delete"], row["reason"])
    return table


def _published(tmp_path, h, name="store.db") -> str:
    url = f"sqlite:///{tmp_path / name}"
    assert main(["publish", "--artifacts", h.root.uri, "--run", RUN, "--store", url]) == 0
    return url


def _verify_all(tmp_path, h, url, *extra) -> bool:
    report = tmp_path / "v.json"
    loc = ["--artifacts", h.root.uri, "--run", RUN, "--store", url]
    main(["verify", *loc, "--all", "--json", str(report), *extra])
    return json.loads(report.read_text())["passed"]


def _eight(h):
    info = h.generation()
    h.dump(info, 0, DumpKind.SNAPSHOT, n=100)
    for seq in range(1, 8):
        h.dump(info, seq, evict=1)
    return info


def test_dumps_a_base_covers_go_the_newest_stays_and_every_reader_still_works(tmp_path, h, capsys):
    _eight(h)
    url = _published(tmp_path, h)
    compact(h.root, RUN, through_seq=7)
    dry = _gc(h, [url], "--dry-run", capsys=capsys)
    assert all(h.root.exists(h.root.dump_dir(RUN, 1, s)) for s in range(8))  # nothing deleted
    assert dry[("dump", 1, 7)] == (False, "the newest dump of generation 1 (the chain's end)")
    assert all(dry[("dump", 1, s)] == (True, "covered by base-000001-000007") for s in range(7))
    assert dry[("base", 1, 7)][0] is False
    done = _gc(h, [url], capsys=capsys)
    assert done == dry
    assert h.root.committed_seqs(RUN, 1) == [7]
    assert _verify_all(tmp_path, h, url)
    assert main(["inspect", "--artifacts", h.root.uri, "--run", RUN]) == 0
    fresh = _published(tmp_path, h, "fresh.db")  # an empty store starts from the base
    assert _verify_all(tmp_path, h, fresh)


def test_an_older_base_no_kept_point_reads_is_deleted(tmp_path, h, capsys):
    _eight(h)
    url = _published(tmp_path, h)
    compact(h.root, RUN, through_seq=3)
    compact(h.root, RUN, through_seq=6)
    table = _gc(h, [url], capsys=capsys)
    assert table[("base", 1, 3)] == (
        True,
        "superseded by base-000001-000006; no kept point reads it",
    )
    assert list_bases(h.root, RUN) == [(1, 6)]
    assert h.root.committed_seqs(RUN, 1) == [7]
    assert _verify_all(tmp_path, h, url)


def test_a_kept_promotion_keeps_what_its_rollback_reads(tmp_path, h, capsys):
    info = h.generation()
    h.dump(info, 0, DumpKind.SNAPSHOT, n=100)
    for seq in range(1, 4):
        h.dump(info, seq)
    url = _published(tmp_path, h)
    loc = ["--artifacts", h.root.uri, "--run", RUN, "--store", url]
    assert _verify_all(tmp_path, h, url)
    assert main(["promote", *loc, "--generation", "1"]) == 0  # the point 1/3
    for seq in range(4, 8):
        h.dump(info, seq)
    compact(h.root, RUN, through_seq=7)
    table = _gc(h, [url], capsys=capsys)
    why = "rollback target generation 1 dump 3 (a kept promotion)"
    assert [table[("dump", 1, s)] for s in range(4)] == [(False, why)] * 4
    assert all(table[("dump", 1, s)][0] for s in range(4, 7))
    assert len(expected_state(h.root, RUN, 1, 3).manifests) == 4  # still readable
    _gc(h, [url], "--keep-promotions", "0", capsys=capsys)
    assert h.root.committed_seqs(RUN, 1) == [7]


def test_a_kept_checkpoint_keeps_the_dumps_a_restore_republishes(tmp_path, h, capsys):
    _eight(h)
    url = _published(tmp_path, h)
    compact(h.root, RUN, through_seq=3)
    compact(h.root, RUN, through_seq=7)
    step = 40  # the end of dump 3 (each dump is 10 steps)
    table = _gc(h, [url], "--checkpoint", f"1:{step}", capsys=capsys)
    why = f"a restore from checkpoint generation 1 step {step} reads it"
    assert all(table[("dump", 1, s)] == (False, why) for s in range(4, 7))
    assert table[("base", 1, 3)] == (False, why)  # the restored point is read from it
    assert h.root.committed_seqs(RUN, 1) == [4, 5, 6, 7]
    assert len(expected_state(h.root, RUN, 1, 3).tables) == 2


def test_a_lagging_store_keeps_dumps_only_a_childs_base_covers(tmp_path, h, capsys):
    parent = h.generation()
    h.dump(parent, 0, DumpKind.SNAPSHOT, n=100)
    for seq in range(1, 3):
        h.dump(parent, seq)
    lagging = _published(tmp_path, h, "lagging.db")  # holds generation 1 through dump 2
    for seq in range(3, 5):
        h.dump(parent, seq)
    child = h.generation(Parent(parent.generation, h.step))
    for seq in range(1, 4):
        h.dump(child, seq)
    compact(h.root, RUN, child.generation)  # folds generation 1 through dump 4
    table = _gc(h, [lagging], capsys=capsys)
    assert table[("dump", 1, 3)] == (
        False,
        f"store {_describe(lagging)} holds generation 1 only through dump 2",
    )
    assert table[("dump", 1, 4)][0] is False
    assert all(table[("dump", 1, s)][0] for s in range(3))
    assert _published(tmp_path, h, "lagging.db")  # generation 2 publishes into it


def test_a_lagging_store_of_a_generation_with_its_own_base_is_caught_up_from_it(
    tmp_path, h, capsys
):
    info = h.generation()
    h.dump(info, 0, DumpKind.SNAPSHOT, n=100)
    lagging = _published(tmp_path, h, "lagging.db")
    for seq in range(1, 8):
        h.dump(info, seq)
    compact(h.root, RUN, through_seq=7)
    _gc(h, [lagging], capsys=capsys)
    assert h.root.committed_seqs(RUN, 1) == [7]
    _published(tmp_path, h, "lagging.db")
    assert _verify_all(tmp_path, h, lagging)


def test_a_running_trainer_keeps_the_dumps_a_store_lacks(tmp_path, h, capsys):
    info = h.generation()
    h.dump(info, 0, DumpKind.SNAPSHOT, n=100)
    url = _published(tmp_path, h)
    for seq in range(1, 6):
        h.dump(info, seq)
    compact(h.root, RUN, through_seq=5)
    lease = RunLease.acquire(h.root, RUN)
    try:
        lease.set_generation(info.generation)
        table = _gc(h, [url], "--dry-run", capsys=capsys)
    finally:
        lease.release()
    assert all(table[("dump", 1, s)][0] is False for s in range(1, 6))
    assert "a running trainer writes generation 1" in table[("dump", 1, 1)][1]
    assert table[("dump", 1, 0)] == (True, "covered by base-000001-000005")


def _describe(url: str) -> str:
    from deltarec.stores import open_store

    with open_store(url) as s:
        return s.describe()


def test_a_gc_cut_short_leaves_readers_working_and_a_rerun_finishes(tmp_path, h, capsys):
    from deltarec.artifacts.retention import Needs, apply, plan

    _eight(h)
    url = _published(tmp_path, h)
    compact(h.root, RUN, through_seq=7)
    decisions = plan(h.root, RUN, Needs())
    calls = []
    real_rm = h.root.fs.rm

    def dies_at_the_fourth(path, recursive=False):
        calls.append(path)
        if len(calls) == 4:  # after a manifest and a folder, then one more manifest: killed
            raise KeyboardInterrupt
        real_rm(path, recursive=recursive)

    h.root.fs.rm = dies_at_the_fourth
    try:
        with pytest.raises(KeyboardInterrupt):
            apply(h.root, RUN, decisions)
    finally:
        h.root.fs.rm = real_rm
    assert h.root.list_dumps(RUN, 1) == [2, 3, 4, 5, 6, 7]  # dump 1 has no manifest: ignored
    assert h.root.list_incomplete_dumps(RUN, 1) == [1]
    assert _verify_all(tmp_path, h, url)
    _gc(h, [url], capsys=capsys)
    assert h.root.committed_seqs(RUN, 1) == [7] and h.root.list_incomplete_dumps(RUN, 1) == []
    assert _verify_all(tmp_path, h, url)


def test_an_abandoned_incomplete_base_goes_once_a_later_base_supersedes_it(tmp_path, h, capsys):
    from deltarec.artifacts.compact_parts import compact_partition

    _eight(h)
    url = _published(tmp_path, h)
    compact_partition(h.root, RUN, 1, 4, key_range=(0, 2))  # a fan-out killed, never re-run
    compact(h.root, RUN, through_seq=6)
    compact_partition(h.root, RUN, 1, 7, key_range=(0, 2))  # one being written now
    table = _gc(h, [url], "--dry-run", capsys=capsys)
    assert table[("base", 1, 4)] == (True, "incomplete (no BASE.json) and superseded by " +
                                     "base-000001-000006")  # fmt: skip
    assert ("base", 1, 7) not in table  # newer than every committed base: it stays
    _gc(h, [url], capsys=capsys)
    assert h.root.base_dirs(RUN) == [(1, 6), (1, 7)]
    assert _verify_all(tmp_path, h, url)
