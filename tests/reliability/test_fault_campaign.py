"""The fault campaign: a publishing 2-rank ``deltarec train`` killed (``kill -9`` of its whole
process tree) at its worst moments, its store server stopped mid-publish, and a second trainer
started on its run - and at the end the store equals the model's final tables, key by key.
Then ``deltarec compact`` (in one step and fanned out) and ``deltarec gc`` are killed at their
fault points on the finished run and re-run, and every reader still sees exactly the model's
tables (tests/_helpers/history_faults.py).

``make test`` runs the short campaign (marker ``faults``); the long one (``faults_long``) runs
on demand (``pytest -m faults_long tests/reliability`` or ``DELTAREC_FAULTS_LONG=1``) and
writes its figures to ``$DELTAREC_FAULTS_REPORT`` (JSON) for RELIABILITY.md.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
from tests._helpers.campaign import Campaign, Trainer
from tests._helpers.history_faults import compaction_and_gc_killed

from deltarec.artifacts import ArtifactRoot, parse_time
from deltarec.faults import COMPACT_POINTS, GC_POINTS, POINTS

pytestmark = [pytest.mark.multiprocess, pytest.mark.integration]

ORPHAN_LIMIT_S = 5.0


def _committed(c: Campaign) -> int:
    root = ArtifactRoot(str(c.artifacts))
    return sum(len(root.list_dumps(c.run, g)) for g in root.list_generations(c.run))


def _wait_for(what: str, check, trainer: Trainer, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert trainer.proc.poll() is None, f"trainer exited before {what}: {trainer.tail()}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s: {trainer.tail()}"
        time.sleep(0.05)


def _kill_at(c: Campaign, point: str, while_held=None) -> None:
    trainer = c.start(fault=point)
    reached = c.wait_fault(trainer, point.split("@")[0])
    assert reached, f"the trainer ended before {point}: {trainer.tail()}"
    if while_held is not None:
        while_held(trainer)
    assert c.kill(trainer, point) < ORPHAN_LIMIT_S, "ranks outlived their launcher"


def _finish(c: Campaign, trainer: Trainer | None = None) -> tuple[int, int]:
    trainer = trainer or c.start()
    rc = trainer.wait(600)
    assert rc == 0, trainer.tail()
    checked, lost, per_table = c.compare()
    assert checked > 10000 and lost == 0, per_table
    return checked, lost


def _second_trainer_refused(c: Campaign, first: Trainer) -> None:
    _wait_for("lease", lambda: (c.artifacts / c.run / "LEASE").exists(), first)
    second = c.start()
    rc = second.wait(120)
    text = second.tail()
    assert rc == 2, text
    assert "being trained by another trainer" in text, text
    assert any(f"pid {pid} since" in text for pid in first.ranks()), text


@pytest.mark.faults
def test_a_trainer_killed_at_its_worst_moments_restarts_and_the_store_equals_the_model(tmp_path):
    c = Campaign(tmp_path, f"sqlite:///{tmp_path}/store.db", steps=60)
    # shards written, manifest not; meanwhile a second trainer of the run refuses to start
    _kill_at(c, "commit.manifest@3", while_held=lambda t: _second_trainer_refused(c, t))
    _kill_at(c, "publish.batch@4")  # a dump half in the store
    _finish(c)
    assert len(ArtifactRoot(str(c.artifacts)).list_generations(c.run)) == 3
    # a fan-out's partition killed mid-part, then gc killed between a manifest and its folder
    compaction_and_gc_killed(c, [("partition", "compact.part@2"), ("gc", "gc.delete@2")])


def _outage(c: Campaign, server, seconds: float) -> Trainer:
    trainer = c.start()
    _wait_for("two committed dumps", lambda: _committed(c) >= 2, trainer)
    server.stop()
    try:
        time.sleep(seconds)
    finally:
        server.start()
    return trainer


@pytest.mark.faults
def test_the_store_server_down_mid_publish_loses_nothing(tmp_path, postgres_server):
    c = Campaign(tmp_path, f"{postgres_server.url}?schema=outage", steps=80)
    trainer = _outage(c, postgres_server, 5.0)
    _finish(c, trainer)
    assert "retrying in" in trainer.log.read_text(), "the outage did not hit a publish"


# ---- the long campaign (on demand) ---------------------------------------------------------
def _report(name: str, figures: dict[str, object]) -> None:
    path = os.environ.get("DELTAREC_FAULTS_REPORT")
    if not path:
        return
    report = json.loads(Path(path).read_text()) if Path(path).exists() else {}
    report[name] = figures
    Path(path).write_text(json.dumps(report, indent=2))


@pytest.mark.faults_long
def test_long_campaign_kills_at_every_moment_and_at_random_times(tmp_path):
    rng_seed = int(os.environ.get("DELTAREC_FAULTS_SEED", "7"))
    rng = random.Random(rng_seed)
    c = Campaign(tmp_path / "points", f"sqlite:///{tmp_path}/points.db", steps=400,
                 checkpoint_every=40)  # fmt: skip
    for point in POINTS:
        for nth in (2, 7):
            _kill_at(c, f"{point}@{nth}")
    checked, lost = _finish(c)
    history = compaction_and_gc_killed(c, HISTORY_KILLS)
    assert {p.split()[1].split("@")[0] for p in history} == {*COMPACT_POINTS, *GC_POINTS}
    # the random kills get a run of their own: after the kills at fault points the first run's
    # training may be over, and a kill of a finished trainer tests nothing
    r = Campaign(tmp_path / "random", f"sqlite:///{tmp_path}/random.db", steps=400,
                 checkpoint_every=40)  # fmt: skip
    latest = float(os.environ.get("DELTAREC_FAULTS_RANDOM_MAX_S", "30"))
    wanted = int(os.environ.get("DELTAREC_FAULTS_RANDOM_KILLS", "8"))
    for _ in range(wanted):
        trainer = r.start()
        trainer.wait_ranks()
        time.sleep(rng.uniform(2.0, latest))  # from model building to the last steps
        if trainer.proc.poll() is not None:
            assert trainer.proc.returncode == 0, trainer.tail()
            break
        assert r.kill(trainer, "random") < ORPHAN_LIMIT_S
    assert wanted == 0 or r.kills, "every random launch finished before its kill"
    r_checked, r_lost = _finish(r)
    kills = [*c.kills, *r.kills]
    _report(
        "kills",
        {
            "seed": rng_seed,
            "kills": len(kills),
            "moments": [k["moment"] for k in kills],
            "slowest_rank_exit_s": max(float(k["ranks_gone_s"]) for k in kills),  # type: ignore[arg-type]
            "launches": c.launches + r.launches,
            "restored_from": _restores(c),
            "random_restored_from": _restores(r),
            "keys_checked": checked,
            "keys_lost": lost,
            "random_keys_checked": r_checked,
            "random_keys_lost": r_lost,
            "compaction_and_gc_kills": history,
        },
    )


HISTORY_KILLS = [
    ("compact", "compact.part@2"),
    ("partition", "compact.partition@1"),
    ("compact", "compact.base_json"),
    ("partition", "compact.part@3"),
    ("gc", "gc.delete@2"),
]
"""The long campaign's kills of compaction and gc: every fault point of both, each re-run."""


@pytest.mark.faults_long
def test_long_campaign_store_server_down_for_30_seconds(tmp_path, postgres_server):
    seconds = float(os.environ.get("DELTAREC_FAULTS_OUTAGE_S", "30"))
    c = Campaign(tmp_path, f"{postgres_server.url}?schema=outage_long", steps=400)
    trainer = _outage(c, postgres_server, seconds)
    checked, lost = _finish(c, trainer)
    assert "retrying in" in trainer.log.read_text()
    _report("outage", {"outage_s": seconds, "keys_checked": checked, "keys_lost": lost})


@pytest.mark.faults_long
def test_long_campaign_a_hung_trainer_is_taken_over_and_stops_without_committing(tmp_path):
    c = Campaign(tmp_path, f"sqlite:///{tmp_path}/store.db", steps=300, lease_ttl=3.0)
    first = c.start()
    first.wait_ranks()
    _second_trainer_refused(c, first)
    _wait_for("three committed dumps", lambda: _committed(c) >= 3, first)
    first.signal_tree(signal.SIGSTOP)  # hung: it neither renews nor writes
    try:
        time.sleep(4.0)  # past its lease
        second = c.start()
        # the second takes the lease and opens its generation; it may then wait for a store
        # lock the hung one holds (a SQLite write transaction), so the hung one wakes now
        _wait_for("the second generation", lambda: _generations(c) >= 2, second)
    finally:
        first.signal_tree(signal.SIGCONT)
    rc = first.wait(300)
    text = first.tail()
    assert rc != 0 and ("taken over" in text or "superseded" in text), text
    root = ArtifactRoot(str(c.artifacts))
    taken = parse_time(root.read_generation(c.run, 2).created_at)
    late = [s for s in root.list_dumps(c.run, 1) if _manifest_time(root, c, 1, s) > taken]
    assert late == [], f"generation 1 committed dumps {late} after generation 2 took over"
    checked, lost = _finish(c, second)
    _report("takeover", {"first_exit": rc, "keys_checked": checked, "keys_lost": lost})


def _restores(c: Campaign) -> list[int | None]:
    """Per launch: the checkpoint step it resumed from (None: a fresh start)."""
    out: list[int | None] = []
    for log in sorted(c.workdir.glob("launch-*.log")):
        text = log.read_text(errors="replace")
        mark = "resumed from checkpoint step "
        at = text.find(mark)
        out.append(int(text[at + len(mark) :].split()[0]) if at >= 0 else None)
    return out


def _generations(c: Campaign) -> int:
    return len(ArtifactRoot(str(c.artifacts)).list_generations(c.run))


def _manifest_time(root: ArtifactRoot, c: Campaign, g: int, s: int) -> float:
    return parse_time(root.read_manifest(c.run, g, s).created_at)
