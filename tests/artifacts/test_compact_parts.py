"""A base built by partitions (a table and key range each) and then committed (SPEC §3a)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from deltarec.artifacts import ArtifactRoot, DumpKind
from deltarec.artifacts.base import list_bases, read_base
from deltarec.artifacts.compact import compact
from deltarec.artifacts.compact_parts import (
    commit_base,
    compact_partition,
    estimate_rows,
    parse_key_range,
    part_span,
)
from deltarec.artifacts.lineage import expected_state
from deltarec.cli import main
from deltarec.errors import BadInputError

from .test_compact import PLAIN, RUN, ZCH, History, _read_base_independently, _same


def _history(tmp_path, dumps=4, n=80):
    h = History(ArtifactRoot(str(tmp_path / "art")))
    info = h.generation()
    h.dump(info, 0, DumpKind.SNAPSHOT, n=n)
    for seq in range(1, dumps):
        h.dump(info, seq, n=n, evict=2)
    return h, info.generation, dumps - 1


def test_parts_of_a_table_are_split_between_key_ranges_without_gap_or_overlap():
    for rows in (0, 1, 39, 40, 41, 400):
        for count in (1, 2, 3, 7):
            spans = [part_span(rows, 40, i, count) for i in range(count)]
            placed = [p for s in spans for p in s]
            assert placed == list(range(-(-rows // 40))), (rows, count)


@pytest.mark.parametrize("text", ["3/3", "-1/2", "1", "a/b", "0/0", "0/5000"])
def test_a_bad_key_range_is_refused_naming_it(text):
    with pytest.raises(BadInputError, match="key range"):
        parse_key_range(text)


def test_a_base_built_by_partitions_equals_the_base_built_in_one_step(tmp_path):
    h, g, s = _history(tmp_path)
    for i in range(3):
        compact_partition(h.root, RUN, g, s, tables=[PLAIN], key_range=(i, 3), part_rows=15)
    compact_partition(h.root, RUN, g, s, tables=[ZCH], part_rows=15)
    assert list_bases(h.root, RUN) == []  # nothing is committed before the commit
    result = commit_base(h.root, RUN, g, s, part_rows=15)
    assert result.written and list_bases(h.root, RUN) == [(g, s)]
    _, got = _read_base_independently(h.root, h.root.base_dir(RUN, g, s))
    _same(h.state, got)
    # the same parts, bytes for bytes, as one compaction with the same part size writes
    fanned = read_base(h.root, RUN, g, s)
    other = ArtifactRoot(str(tmp_path / "one"))
    import shutil

    shutil.copytree(tmp_path / "art", tmp_path / "one")
    shutil.rmtree(tmp_path / "one" / RUN / f"base-{g:06d}-{s:06d}")
    single = compact(other, RUN, g, s, part_rows=15).base
    assert [p.to_json() for p in fanned.parts] == [p.to_json() for p in single.parts]
    assert (fanned.lineage, fanned.rows, fanned.last_step) == (
        single.lineage, single.rows, single.last_step,
    )  # fmt: skip
    assert not list((tmp_path / "art" / RUN).glob("base-*/*/partition-*"))  # records dropped


def test_a_commit_with_a_partition_missing_refuses_naming_it_and_the_old_state_stays(tmp_path):
    h, g, s = _history(tmp_path)
    before = expected_state(h.root, RUN, g)
    compact_partition(h.root, RUN, g, s, tables=[PLAIN], key_range=(0, 2), part_rows=15)
    compact_partition(h.root, RUN, g, s, tables=[ZCH], part_rows=15)
    with pytest.raises(BadInputError, match=rf"missing {PLAIN} parts \d+-\d+ of \d+"):
        commit_base(h.root, RUN, g, s, part_rows=15)
    assert list_bases(h.root, RUN) == []
    after = expected_state(h.root, RUN, g)
    assert after.base is None and (after.tables[PLAIN].keys == before.tables[PLAIN].keys).all()
    # the missing range, even cut another way, completes the base
    compact_partition(h.root, RUN, g, s, tables=[PLAIN], key_range=(1, 2), part_rows=15)
    assert commit_base(h.root, RUN, g, s, part_rows=15).written
    _same(h.state, _read_base_independently(h.root, h.root.base_dir(RUN, g, s))[1])


def test_a_rerun_partition_skips_what_is_in_place_and_redoes_a_damaged_part(tmp_path):
    h, g, s = _history(tmp_path)
    first = compact_partition(h.root, RUN, g, s, part_rows=15)
    assert set(first.tables.values()) == {"written"}
    again = compact_partition(h.root, RUN, g, s, part_rows=15)
    assert set(again.tables.values()) == {"done before"}
    part = tmp_path / "art" / RUN / f"base-{g:06d}-{s:06d}" / PLAIN / "part-00001.parquet"
    part.write_bytes(b"cut short")
    with pytest.raises(BadInputError, match=r"part-00001\.parquet is not the one"):
        commit_base(h.root, RUN, g, s, part_rows=15)
    redo = compact_partition(h.root, RUN, g, s, part_rows=15)
    assert redo.tables == {PLAIN: "written", ZCH: "done before"}
    assert commit_base(h.root, RUN, g, s, part_rows=15).written
    _same(h.state, _read_base_independently(h.root, h.root.base_dir(RUN, g, s))[1])


def test_the_row_estimate_bounds_each_tables_rows_from_manifests_alone(tmp_path):
    h, g, s = _history(tmp_path)
    est = estimate_rows(h.root, RUN, g, s)
    for t, rows in h.state.items():
        assert len(rows) <= est[t]
    assert est[PLAIN] <= 400  # a plain table's capacity
    compact(h.root, RUN, g, s - 1)
    after = estimate_rows(h.root, RUN, g, s)  # the base's rows plus the last dump's
    assert all(len(h.state[t]) <= after[t] <= est[t] for t in h.state)


def _cli(*argv):
    return [sys.executable, "-c",
            "import sys; from deltarec.cli import main; sys.exit(main(sys.argv[1:]))",
            "compact", *argv]  # fmt: skip


def test_a_fan_out_killed_mid_partition_leaves_the_old_state_and_a_rerun_commits(tmp_path):
    h, g, s = _history(tmp_path)
    where = ["--artifacts", h.root.uri, "--run", RUN, "--through-seq", str(s), "--part-rows", "15"]
    env = {**os.environ, "DELTAREC_FAULT": "compact.part@2",
           "DELTAREC_FAULT_DIR": str(tmp_path / "faults")}  # fmt: skip
    proc = subprocess.Popen(_cli(*where, "--key-range", "1/2"), env=env)
    deadline = time.monotonic() + 60
    while not (tmp_path / "faults").exists() or not os.listdir(tmp_path / "faults"):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert main(["compact", *where, "--key-range", "0/2"]) == 0
    assert main(["compact", *where, "--commit"]) == 2  # 1/2 was cut short
    assert list_bases(h.root, RUN) == [] and expected_state(h.root, RUN, g).base is None
    assert main(["compact", *where, "--key-range", "1/2", "--json"]) == 0
    assert main(["compact", *where, "--commit"]) == 0
    _same(h.state, _read_base_independently(h.root, h.root.base_dir(RUN, g, s))[1])


def test_the_cli_partition_needs_the_dump_it_folds(tmp_path, capsys):
    h, _, _ = _history(tmp_path, dumps=2)
    assert main(["compact", "--artifacts", h.root.uri, "--run", RUN, "--key-range", "0/2"]) == 2
    assert "needs --through-seq" in capsys.readouterr().err
    argv = ["compact", "--artifacts", h.root.uri, "--run", RUN, "--through-seq", "1", "--json"]
    assert main([*argv, "--tables", PLAIN]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tables"] == {PLAIN: "written"} and out["key_range"] == "0/1"


def test_a_commit_killed_before_base_json_leaves_no_base_and_a_second_commit_writes_it(tmp_path):
    h, g, s = _history(tmp_path)
    where = ["--artifacts", h.root.uri, "--run", RUN, "--through-seq", str(s), "--part-rows", "15"]
    assert main(["compact", *where, "--key-range", "0/1"]) == 0
    env = {**os.environ, "DELTAREC_FAULT": "compact.base_json",
           "DELTAREC_FAULT_DIR": str(tmp_path / "faults")}  # fmt: skip
    proc = subprocess.Popen(_cli(*where, "--commit"), env=env)
    deadline = time.monotonic() + 60
    while not (tmp_path / "faults").exists() or not os.listdir(tmp_path / "faults"):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert list_bases(h.root, RUN) == [] and expected_state(h.root, RUN, g).base is None
    assert main(["compact", *where, "--commit"]) == 0
    _same(h.state, _read_base_independently(h.root, h.root.base_dir(RUN, g, s))[1])
