"""``deltarec compact`` and ``deltarec gc`` killed (``kill -9``) at their fault points on a
campaign's finished run, each followed by a re-run that completes, and a key-by-key check that
readers see exactly the model's tables (:mod:`tests._helpers.campaign`, the fault campaign).

Readers checked: the artifacts' own replay (``expected_state``: what verify expects, what a
replica loads, what the next compaction folds) against the exported final tables; ``verify
--all`` of the campaign's store; and, once a base is committed, a store that holds nothing
published from the artifacts (the base, then the dumps after it) against the exported tables.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pyarrow.parquet as pq

from deltarec.artifacts import ArtifactRoot, codec
from deltarec.artifacts.base import list_bases
from deltarec.artifacts.lineage import expected_state
from deltarec.faults import DIR_ENV, ENV

from .campaign import Campaign

_CLI = "import sys; from deltarec.cli import main; sys.exit(main(sys.argv[1:]))"


def where(c: Campaign) -> list[str]:
    """``--artifacts ROOT --run RUN`` of the campaign."""
    return ["--artifacts", str(c.artifacts), "--run", c.run]


def start(c: Campaign, argv: list[str], fault: str | None = None) -> subprocess.Popen[bytes]:
    """``deltarec ARGV`` in its own session (held at ``fault`` if given), logged in the workdir."""
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if fault:
        env.update({ENV: fault, DIR_ENV: str(c.faults)})
    c.launches += 1
    log = open(c.workdir / f"history-{c.launches:02d}-{argv[0]}.log", "wb")  # noqa: SIM115
    with log:
        return subprocess.Popen(
            [sys.executable, "-c", _CLI, *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def run(c: Campaign, argv: list[str]) -> int:
    """``deltarec ARGV`` to its end, in this process (only a killed command needs its own); its
    exit code."""
    from deltarec.cli import main

    return main(argv)


def kill_at(c: Campaign, point: str, argv: list[str]) -> None:
    """Run ``deltarec ARGV`` held at ``point`` (``POINT@N``), then ``kill -9`` its session."""
    proc = start(c, argv, fault=point)
    name = point.split("@")[0]
    deadline = time.monotonic() + 300
    while not (c.faults.exists() and any(c.faults.glob(f"{name}.*"))):
        assert proc.poll() is None, (
            f"deltarec {argv[0]} ended before {point} (rc {proc.returncode})"
        )
        assert time.monotonic() < deadline, f"deltarec {argv[0]} never reached {point}"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for marker in c.faults.glob("*"):
        marker.unlink()
    c.kills.append({"moment": f"{argv[0]} {point}", "ranks_gone_s": 0.0})


def model_tables(c: Campaign) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The exported final tables: ``{table: (keys, float32 rows)}``."""
    out = {}
    for path in sorted(c.export.glob("*.parquet")):
        data = pq.read_table(path)
        rows = np.stack(data.column("embedding").to_numpy(zero_copy_only=False))
        out[path.name[: -len(".parquet")]] = (data.column("key").to_numpy(), rows)
    return out


def replay_equals_model(c: Campaign) -> int:
    """The artifacts' replay of the newest generation equals the model, key by key; keys checked."""
    root = ArtifactRoot(str(c.artifacts))
    state = expected_state(root, c.run, root.latest_generation(c.run))
    checked = 0
    for table, (keys, want) in model_tables(c).items():
        t = state.tables[table]
        np.testing.assert_array_equal(t.present_keys(), np.sort(keys), err_msg=table)
        got = codec.decode(t.load(keys), t.spec.dtype, t.spec.dim)
        np.testing.assert_array_equal(got, want.astype(np.float32), err_msg=table)
        checked += int(keys.size)
    return checked


def readers_see_the_model(c: Campaign, tag: str) -> int:
    """Every reader sees exactly the model's tables (see the module docstring); keys checked."""
    checked = replay_equals_model(c)
    assert run(c, ["verify", *where(c), "--store", c.store, "--all"]) == 0, f"verify ({tag})"
    if list_bases(ArtifactRoot(str(c.artifacts)), c.run):
        fresh = f"sqlite:///{c.workdir}/fresh-{tag}.db"
        assert run(c, ["publish", *where(c), "--store", fresh]) == 0, f"publish ({tag})"
        n, lost, per_table = replace(c, store=fresh).compare()
        assert n == checked and lost == 0, per_table
    return checked


def compaction_and_gc_killed(c: Campaign, points: list[tuple[str, str]]) -> list[str]:
    """Kill compaction and gc at ``points`` (``(what, POINT@N)``), re-run each, check readers.

    ``what`` is ``compact`` (one step), ``partition`` (a fan-out: partition 1/2 killed, 0/2
    written, the commit refused, then 1/2 re-run and committed) or ``gc``. Each compaction
    folds the newest generation through a later dump than the one before (the newest for the
    last), so each one writes a new base, built from the one before; a generation with fewer
    dumps than compactions is folded through its newest dump again, its base removed first
    (only before any gc: until then every dump is there). Returns the moments.
    """
    root = ArtifactRoot(str(c.artifacts))
    g = root.latest_generation(c.run)
    folds = sum(what != "gc" for what, _ in points)
    seqs = root.list_dumps(c.run, g)[-folds:]
    seqs = [*seqs, *[seqs[-1]] * (folds - len(seqs))]  # a short generation: fold again
    store = ["--store", c.store]
    seen: list[str] = []
    for what, point in points:
        tag = f"{len(seen)}-{what}"
        if what == "gc":
            kill_at(c, point, ["gc", *where(c), *store])
            readers_see_the_model(c, f"{tag}-killed")
            assert run(c, ["gc", *where(c), *store]) == 0
        else:
            s = seqs.pop(0)
            if (g, s) in list_bases(root, c.run):  # folded before: every dump is still there
                assert not any(p.startswith("gc") for p in seen), "fold again after a gc"
                shutil.rmtree(c.artifacts / c.run / f"base-{g:06d}-{s:06d}")
            fold = [*where(c), "--through-seq", str(s), "--part-rows", "64"]  # parts: many
            if what == "partition":
                kill_at(c, point, ["compact", *fold, "--key-range", "1/2"])
                assert run(c, ["compact", *fold, "--key-range", "0/2"]) == 0
                assert run(c, ["compact", *fold, "--commit"]) == 2  # 1/2 is not in place
            else:
                kill_at(c, point, ["compact", *fold])
            assert (g, s) not in list_bases(root, c.run)
            readers_see_the_model(c, f"{tag}-killed")
            if what == "partition":
                assert run(c, ["compact", *fold, "--key-range", "1/2"]) == 0
                assert run(c, ["compact", *fold, "--commit"]) == 0
            else:
                assert run(c, ["compact", *fold]) == 0
            assert (g, s) in list_bases(root, c.run), f"no base after re-running {what}"
        readers_see_the_model(c, f"{tag}-rerun")
        seen.append(f"{what} {point}")
    return seen
