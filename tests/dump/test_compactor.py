"""The trainer's background compaction: every N committed dumps, in a child process."""

from __future__ import annotations

import os
import threading
import time

import pytest
from tests.artifacts.test_compact import RUN, History, _read_base_independently, _same

from deltarec.artifacts import ArtifactRoot, DumpKind
from deltarec.artifacts.base import list_bases
from deltarec.dump.compactor import BackgroundCompactor, compactor_for
from deltarec.dump.config import DumperConfig
from deltarec.publish import yieldcpu


def _wait(predicate, seconds=60.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_every_nth_committed_dump_is_compacted_in_the_background(tmp_path):
    h = History(ArtifactRoot(str(tmp_path / "art")))
    info = h.generation()
    c = BackgroundCompactor(h.root.uri, {}, RUN, info.generation, every=3)
    try:
        for seq in range(0, 3):
            h.dump(info, seq, DumpKind.SNAPSHOT if seq == 0 else DumpKind.DELTA)
            c.committed(h.root.read_manifest(RUN, info.generation, seq))
        _wait(lambda: c.compactions == 1)
        assert list_bases(h.root, RUN) == [(info.generation, 2)]
        _, got = _read_base_independently(h.root, h.root.base_dir(RUN, info.generation, 2))
        _same(h.state, got)
        for seq in range(3, 5):  # not a multiple of 3 yet: nothing more
            h.dump(info, seq)
            c.committed(h.root.read_manifest(RUN, info.generation, seq))
        time.sleep(0.3)
        assert c.compactions == 1 and c.failures == 0
        ((start, end),) = c.spans  # the one compaction's wall time, nothing running now
        assert end > start and c.running_since is None
        report = c.last_report
        assert report is not None and report["dumps_read"] == 3
        if hasattr(os, "SCHED_IDLE"):  # the child yields the CPU and the disk to training
            assert report["policy"] == os.SCHED_IDLE
        if yieldcpu.io_priority_class() is not None:
            assert report["io_class"] == yieldcpu.IOPRIO_CLASS_IDLE
    finally:
        c.close()
    assert list_bases(h.root, RUN) == [(info.generation, 2)]


def test_only_rank_0_of_a_trainer_that_asks_compacts(tmp_path):
    config = DumperConfig(artifacts=str(tmp_path), run=RUN, compact_every_dumps=10)
    assert compactor_for(config, 1, 1) is None
    assert compactor_for(DumperConfig(artifacts=str(tmp_path), run=RUN), 1, 0) is None
    c = compactor_for(config, 1, 0)
    assert c is not None and c.every == 10
    c.close()


@pytest.mark.skipif(yieldcpu.io_priority_class() is None, reason="Linux I/O priorities only")
def test_lowering_io_priority_changes_the_calling_thread_only():
    mine = yieldcpu.io_priority_class()
    seen: list[object] = []

    def lowered() -> None:
        seen.append(yieldcpu.lower_io())
        seen.append(yieldcpu.io_priority_class())

    t = threading.Thread(target=lowered)
    t.start()
    t.join()
    assert seen == [True, yieldcpu.IOPRIO_CLASS_IDLE]
    assert yieldcpu.io_priority_class() == mine != yieldcpu.IOPRIO_CLASS_IDLE


def test_a_paced_background_compaction_reports_its_busy_share_and_the_time_it_slept(tmp_path):
    h = History(ArtifactRoot(str(tmp_path / "art")))
    info = h.generation()
    c = BackgroundCompactor(h.root.uri, {}, RUN, info.generation, every=1, busy_share=0.25)
    try:
        h.dump(info, 0, DumpKind.SNAPSHOT)
        c.committed(h.root.read_manifest(RUN, info.generation, 0))
        _wait(lambda: c.compactions == 1)
        report = c.last_report
        assert report is not None and report["busy_share"] == 0.25
        assert report["pauses"] >= 1 and report["checkpoints"] > report["pauses"]
        assert report["paced_s"] >= 3 * report["busy_s"] - 0.01  # slept 3 s a second worked
    finally:
        c.close()
    _, got = _read_base_independently(h.root, h.root.base_dir(RUN, info.generation, 0))
    _same(h.state, got)


def test_triggers_that_come_while_a_compaction_runs_are_folded_into_the_newest(tmp_path):
    h = History(ArtifactRoot(str(tmp_path / "art")))
    info = h.generation()
    c = BackgroundCompactor(h.root.uri, {}, RUN, info.generation, every=1, busy_share=0.1)
    try:
        for seq in range(4):  # all within the first compaction's start: it has fallen behind
            h.dump(info, seq, DumpKind.SNAPSHOT if seq == 0 else DumpKind.DELTA)
            c.committed(h.root.read_manifest(RUN, info.generation, seq))
        _wait(lambda: (info.generation, 3) in list_bases(h.root, RUN) and c.running_since is None)
        assert c.triggered == 4 and c.failures == 0
        assert c.skipped >= 1 and c.compactions + c.skipped == 4  # never two at once
        assert c.compactions == len(list_bases(h.root, RUN))
    finally:
        c.close()
    _, got = _read_base_independently(h.root, h.root.base_dir(RUN, info.generation, 3))
    _same(h.state, got)


def test_a_busy_share_outside_zero_to_one_is_refused_naming_the_setting(tmp_path):
    from deltarec.dump import make_train_hook
    from deltarec.errors import BadInputError, ConfigError

    with pytest.raises(ConfigError, match="compact_busy_share"):
        make_train_hook(
            artifacts=str(tmp_path), run=RUN, every_steps=1, compact_every_dumps=2,
            compact_busy_share=0,
        )  # fmt: skip
    with pytest.raises(ConfigError, match="compact_busy_share"):
        make_train_hook(artifacts=str(tmp_path), run=RUN, every_steps=1, compact_busy_share=1.5)
    with pytest.raises(BadInputError, match="busy_share"):
        BackgroundCompactor(str(tmp_path), {}, RUN, 1, every=1, busy_share=0)
    config = DumperConfig(artifacts=str(tmp_path), run=RUN, compact_every_dumps=2)
    c = compactor_for(config.model_copy(update={"compact_busy_share": 0.3}), 1, 0)
    assert c is not None and c.busy_share == 0.3
    c.close()
    d = compactor_for(config, 1, 0)
    assert d is not None and d.busy_share == config.compact_busy_share
    d.close()
