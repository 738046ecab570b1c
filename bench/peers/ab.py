"""deltarec against deltarec: two checkouts of the code, alternating, on the same rows and server.

The peer benchmark (:mod:`bench_peers`) compares deltarec with Feast; a change to deltarec is
judged against the code before it, measured beside it on the same (shared, noisy) machine.
Each code is a ``src`` folder put first on ``PYTHONPATH`` (e.g. a ``git worktree`` of the
commit before the change; more folders after a ``:``). For every repeat each code, in
alternating order (the first code first on even repeats), publishes the snapshot into a fresh
store, verifies it with ``--all`` and publishes the update dump (every key again, from a copy
of the artifacts that holds it). A Redis store is emptied before each code's turn and its
append-only file rewritten (waited for), so every turn starts from the same server state.
Prints one line per process (wall s, CPU s, peak RSS MB, load average) and the medians.

    .venv/bin/python bench/peers/ab.py --store redis --rows 500000 --repeat 3 \\
        --code base=/tmp/base/src new=src [--profile new --profile-dir /tmp/prof]

``--profile NAME`` runs that code once more after the timed repeats under ``py-spy record``
(``bench/peers/.venv``, see setup.sh), writing one speedscope file per phase.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import rows as peer_rows  # noqa: E402  (bench/peers/rows.py)
from bench_peers import DELTAREC, servers, store_url, timed  # noqa: E402

PY_SPY = os.path.join(HERE, ".venv", "bin", "py-spy")
PHASES = ("publish", "verify", "update")


def run(code: str, argv: list[str], profile: str | None = None) -> tuple[float, float, float]:
    """``deltarec argv`` with ``code``'s folders first on PYTHONPATH: wall s, CPU s, RSS MB."""
    os.environ["PYTHONPATH"] = os.pathsep.join(os.path.abspath(c) for c in code.split(":"))
    try:
        cmd = [DELTAREC, *argv]
        if profile is not None:
            spy = [PY_SPY, "record", "--threads", "--idle", "-r", "250", "-f", "speedscope"]
            cmd = [*spy, "-o", profile, "--", sys.executable, *cmd]
        os.sync()  # the write-back of the last process's files does not land in this one's
        return timed(cmd)[:3]
    finally:
        del os.environ["PYTHONPATH"]


def fresh_redis(server: Any) -> None:
    """Empty the server and rewrite its append-only file (waited for)."""
    import redis  # deltarec's environment has it (the redis extra)

    client = redis.Redis(port=server.port)

    def rewriting() -> bool:
        info = client.info("persistence")
        return bool(info["aof_rewrite_in_progress"] or info["aof_rewrite_scheduled"])

    while rewriting():  # one the last turn's writes started
        time.sleep(0.05)
    client.flushall()
    client.bgrewriteaof()
    while rewriting():
        time.sleep(0.05)
    client.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", choices=("sqlite", "postgres", "redis"), required=True)
    p.add_argument("--rows", type=int, default=500_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--code", nargs="+", required=True, help="NAME=SRC_DIR[:MORE_DIRS] ...")
    p.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES)
    p.add_argument("--profile", default=None, help="NAME of a code to profile once")
    p.add_argument("--profile-dir", default="/tmp/prof")
    a = p.parse_args()
    codes = [tuple(c.split("=", 1)) for c in a.code]
    base = tempfile.mkdtemp(prefix="deltarec-ab-")
    records: list[dict[str, Any]] = []
    try:
        with servers([a.store]) as held:
            work = os.path.join(base, "rows")
            os.makedirs(work)
            art = peer_rows.build(work, a.rows, a.dim)
            updated = os.path.join(base, "updated")
            shutil.copytree(work, updated)
            peer_rows.write_update(updated)
            art_updated = os.path.join(updated, "art")

            def turn(rep: int, name: str, src: str, prof: bool) -> None:
                if a.store == "redis":
                    fresh_redis(held["redis"])
                url = store_url(a.store, work, held, f"{name}{rep}")
                for phase in a.phases:
                    source = art_updated if phase == "update" else art
                    argv = ["verify" if phase == "verify" else "publish", "--artifacts", source]
                    argv += ["--run", peer_rows.RUN, "--store", url]
                    if phase == "verify":
                        argv.append("--all")
                    out = None
                    if prof:
                        os.makedirs(a.profile_dir, exist_ok=True)
                        out = os.path.join(a.profile_dir, f"{a.store}-{phase}-{name}.json")
                    wall, cpu, rss = run(src, argv, out)
                    rec = dict(code=name, phase=phase, rep=rep, wall=wall, cpu=cpu, rss=rss)
                    rec["load"] = os.getloadavg()[0]
                    print(f"# {rec}", file=sys.stderr, flush=True)
                    if not prof:
                        records.append(rec)

            for rep in range(a.repeat):
                for name, src in codes if rep % 2 == 0 else codes[::-1]:
                    turn(rep, name, src, False)
            if a.profile:
                turn(a.repeat, a.profile, dict(codes)[a.profile], True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"{a.store}, {a.rows:,} rows; wall s (CPU s) per repeat; median wall")
    for phase in a.phases:
        for name, _ in codes:
            mine = [r for r in records if r["phase"] == phase and r["code"] == name]
            if not mine:
                continue
            walls = ", ".join(f"{r['wall']:.2f} ({r['cpu']:.2f})" for r in mine)
            med = statistics.median(r["wall"] for r in mine)
            print(f"{phase:8s} {name:6s} {walls}  median {med:.2f} s = {a.rows / med:,.0f} rows/s")


if __name__ == "__main__":
    main()
