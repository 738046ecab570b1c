"""Pacing of a background compaction: sleeps between chunks, never changes what is written."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
from tests.artifacts.test_compact import RUN, History, _read_base_independently, _same

from deltarec.artifacts import ArtifactRoot, DumpKind, codec, pacing
from deltarec.artifacts.base import list_bases
from deltarec.artifacts.compact import compact
from deltarec.artifacts.lineage import expected_state
from deltarec.errors import BadInputError


class FakeTime:
    """Clocks that move only when told: working moves both, waiting or sleeping the wall's."""

    def __init__(self) -> None:
        self.now = 100.0
        self.cpu = 7.0
        self.slept: list[float] = []

    def work(self, seconds: float) -> None:
        self.now += seconds
        self.cpu += seconds

    def wait(self, seconds: float) -> None:  # for a core, at idle priority
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    def pacer(self, share: float) -> pacing.Pacer:
        return pacing.Pacer(share, cpu_clock=lambda: self.cpu, clock=lambda: self.now,
                            sleep=self.sleep)  # fmt: skip


def test_a_pacer_sleeps_after_each_chunk_to_keep_its_busy_share():
    t = FakeTime()
    p = t.pacer(0.25)
    for _ in range(4):
        t.work(0.1)
        t.wait(0.05)  # waiting for a core is not work: no pause for it
        p.checkpoint()
    assert t.slept == pytest.approx([0.3] * 4)
    assert p.busy_s == pytest.approx(0.4) and p.paced_s == pytest.approx(1.2)
    assert p.report() == {
        "busy_share": 0.25,
        "busy_s": pytest.approx(0.4),
        "paced_s": pytest.approx(1.2),
        "pauses": 4,
        "checkpoints": 4,
    }


def test_short_pauses_are_owed_and_slept_together_keeping_the_share_over_the_run():
    t = FakeTime()
    p = t.pacer(0.5)
    for _ in range(20):
        t.work(1 / 512)  # exact in binary: 3 chunks owe 5.9 ms, one pause
        p.checkpoint()
    assert t.slept == pytest.approx([3 / 512] * 6)
    assert 0 <= p.busy_s - p.paced_s < pacing.MIN_PAUSE_S  # the last 2 chunks' pause is owed


def test_a_pacer_at_share_one_never_sleeps():
    t = FakeTime()
    p = t.pacer(1.0)
    t.work(5.0)
    p.checkpoint()
    assert t.slept == [] and p.paced_s == 0.0 and p.busy_s == pytest.approx(5.0)


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5, float("nan")])
def test_a_busy_share_outside_zero_to_one_is_refused_naming_it(share):
    with pytest.raises(BadInputError, match="busy_share must be in"):
        pacing.Pacer(share)


def test_a_checkpoint_without_a_pacer_returns_at_once():
    pacing.checkpoint()  # verify and publish share these readers: no pacer, no pause
    with pacing.paced(0.5) as p:
        pacing.checkpoint()
    pacing.checkpoint()
    assert p.checkpoints == 1


def _history(tmp_path):
    h = History(ArtifactRoot(str(tmp_path / "art")))
    info = h.generation()
    h.dump(info, 0, DumpKind.SNAPSHOT, n=150)
    for seq in range(1, 5):
        h.dump(info, seq, evict=2)
    return h, info


def _files(base_dir):
    out = {}
    for d, _, names in os.walk(base_dir):
        for n in names:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), base_dir)] = f.read()
    meta = json.loads(out.pop("BASE.json"))
    meta.pop("created_at")
    return out, meta


def test_a_paced_compaction_writes_byte_for_byte_the_base_of_an_unpaced_one(tmp_path, monkeypatch):
    # small row groups: each part is gathered, encoded and written in several chunks
    monkeypatch.setattr(codec, "row_group_rows", lambda dtype, dim: 16)
    h, info = _history(tmp_path)
    shutil.copytree(tmp_path / "art", tmp_path / "copy")
    other = ArtifactRoot(str(tmp_path / "copy"))
    compact(h.root, RUN, part_rows=70)
    with pacing.paced(0.2) as pacer:
        compact(other, RUN, part_rows=70)
    assert pacer.pauses > 0 and pacer.paced_s > 0  # it did sleep
    assert pacer.paced_s >= 3.9 * pacer.busy_s - pacing.MIN_PAUSE_S
    unpaced = _files(h.root.base_dir(RUN, info.generation, 4))
    paced = _files(other.base_dir(RUN, info.generation, 4))
    assert paced == unpaced and len(unpaced[0]) > 2
    _, got = _read_base_independently(other, other.base_dir(RUN, info.generation, 4))
    _same(h.state, got)


def test_a_part_written_a_row_group_at_a_time_is_one_write_of_the_whole_part(tmp_path, monkeypatch):
    monkeypatch.setattr(codec, "row_group_rows", lambda dtype, dim: 16)
    h, info = _history(tmp_path)
    compact(h.root, RUN, part_rows=70)
    parts, _ = _files(h.root.base_dir(RUN, info.generation, 4))
    for data in parts.values():
        table = pq.read_table(io.BytesIO(data))
        assert pq.ParquetFile(io.BytesIO(data)).metadata.num_row_groups == -(-len(table) // 16)
        whole = io.BytesIO()
        pq.write_table(table, whole, row_group_size=16)
        assert whole.getvalue() == data


def test_a_paced_compaction_killed_asleep_leaves_the_previous_base_and_a_rerun_completes(tmp_path):
    h, info = _history(tmp_path)
    compact(h.root, RUN, info.generation, 2, part_rows=70)  # the previous state: a base at 2
    # at a 3% share the first part lands after ~2 s and the rest takes ~5 s more of pauses: room
    # enough to kill it asleep without a run that mostly waits for its first part
    program = (
        "import sys; from deltarec.artifacts import ArtifactRoot, pacing\n"
        "from deltarec.artifacts.compact import compact\n"
        "with pacing.paced(0.03):\n"
        f"    compact(ArtifactRoot(sys.argv[1]), {RUN!r}, {info.generation}, 4, part_rows=20)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", program, h.root.uri])
    new_dir = h.root.base_dir(RUN, info.generation, 4)
    deadline = time.monotonic() + 60
    while not any(n.endswith(".parquet") for _, _, ns in os.walk(new_dir) for n in ns):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)  # a part written, the rest paced out: it is asleep
    proc.wait()
    assert list_bases(h.root, RUN) == [(info.generation, 2)]
    assert expected_state(h.root, RUN, info.generation).base.through_seq == 2
    assert compact(h.root, RUN, info.generation, 4, part_rows=20).written
    _, got = _read_base_independently(h.root, new_dir)
    _same(h.state, got)


def test_the_cli_paces_a_compaction_when_asked_and_reports_it(tmp_path, capsys):
    from deltarec.cli import main

    h, info = _history(tmp_path)
    argv = ["compact", "--artifacts", h.root.uri, "--run", RUN, "--part-rows", "70", "--json"]
    assert main([*argv, "--busy-share", "0"]) == 2
    assert "--busy-share must be in (0, 1], got 0.0" in capsys.readouterr().err
    assert main([*argv, "--busy-share", "0.2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["written"] and out["pacing"]["busy_share"] == 0.2
    assert out["pacing"]["pauses"] > 0 and out["pacing"]["paced_s"] > 0
    _, got = _read_base_independently(h.root, h.root.base_dir(RUN, info.generation, 4))
    _same(h.state, got)
