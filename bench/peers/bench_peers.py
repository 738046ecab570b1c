"""deltarec vs Feast 0.67 on the same rows, same run: publish/write, update, verify/read.

For each store (SQLite, PostgreSQL, Redis) the same rows are written and read by both sides
in one run, on one machine, against one server:

* **deltarec**, end to end as processes: ``deltarec publish`` of a committed generation (a
  snapshot dump of N random keys, dim 64 float32, 2 ranks' shards) into a fresh store, then
  ``deltarec verify --all`` (every key read back and compared, sha256 of every shard, the
  store scanned for keys the lineage never wrote), then ``deltarec publish`` of a delta that
  rewrites every key (the update). Each time is the process's wall time, start-up included.
* **Feast** (``bench/peers/.venv``, its own virtual environment: ``bench/peers/setup.sh``),
  :mod:`feast_side` as a process: ``write_to_online_store`` of the same rows, the same keys
  again (update, with ``--feast-update``), ``get_online_features`` of every key. Its times
  are of Feast's calls only (no start-up, no DataFrame building): a baseline in its favour.

The two sides alternate (deltarec first on even repeats, Feast first on odd ones), each repeat
into fresh stores. PostgreSQL is a fresh default cluster with fsync, synchronous commit and
full-page writes on (:class:`deltarec.testing.servers.PostgresServer` ``fsync=True``); Redis
is ``redis-server`` with an append-only file (``everysec``). CPU seconds and peak RSS of every
deltarec process are read by ``/usr/bin/time``; Feast's CPU seconds are its process's during
its calls. CPU counts the client process only (not the PostgreSQL or Redis server): on a
loaded machine it is the steadier figure, and for SQLite it is all the work.

    .venv/bin/python bench/peers/bench_peers.py [--stores sqlite postgres redis]
        [--sqlite-rows 1000000] [--server-rows 500000] [--repeat 1] [--skip-feast]
        [--feast-update] [--json out.json]

Prints date, machine, and one table per phase: both rates and the ratio deltarec / Feast.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import rows as peer_rows  # noqa: E402  (bench/peers/rows.py)

from deltarec.testing.servers import PostgresServer, RedisServer  # noqa: E402

PEER_PYTHON = os.path.join(HERE, ".venv", "bin", "python")
DELTAREC = os.path.join(os.path.dirname(sys.executable), "deltarec")
TIME_BIN = os.access("/usr/bin/time", os.X_OK)


def timed(argv: list[str]) -> tuple[float, float, float, str]:
    """Run ``argv``; return its wall seconds, CPU seconds, peak RSS (MB) and stdout.

    CPU and peak RSS are read by ``/usr/bin/time`` where it is there (NaN otherwise): a child
    forked from this (large) process would inherit this process's high-water mark.

    Raises:
        RuntimeError: the process failed (with the tail of its output).
    """
    with tempfile.NamedTemporaryFile("w+") as usage, tempfile.TemporaryFile("w+") as out:
        launcher = ["/usr/bin/time", "-f", "%U %S %M", "-o", usage.name] if TIME_BIN else []
        with tempfile.TemporaryFile("w+") as err:
            t = time.perf_counter()
            done = subprocess.run([*launcher, *argv], stdout=out, stderr=err, check=False)
            seconds = time.perf_counter() - t
            err.seek(0)
            stderr = err.read()
        out.seek(0)
        stdout = out.read()
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} exited {done.returncode}:\n{stdout[-2000:]}{stderr[-4000:]}"
            )
        usage.seek(0)
        lines = usage.read().strip().splitlines()
    if not lines:
        return seconds, float("nan"), float("nan"), stdout
    user, system, rss = lines[-1].split()
    return seconds, float(user) + float(system), float(rss) / 1024, stdout


class Deltarec:
    """``deltarec publish`` / ``verify --all`` as processes."""

    def __init__(self, art: str) -> None:
        self.art = art

    def publish(self, url: str) -> tuple[float, float, float]:
        """Wall s, CPU s, peak RSS MB."""
        argv = [DELTAREC, "publish", "--artifacts", self.art, "--run", peer_rows.RUN]
        return timed([*argv, "--store", url])[:3]

    def verify(self, url: str) -> tuple[float, float, float]:
        """Wall s, CPU s, peak RSS MB."""
        argv = [DELTAREC, "verify", "--artifacts", self.art, "--run", peer_rows.RUN]
        return timed([*argv, "--store", url, "--all"])[:3]


class Feast:
    """:mod:`feast_side` in the peers' virtual environment."""

    def __init__(self, workdir: str, store: str, extra: list[str]) -> None:
        self.base = [
            PEER_PYTHON,
            os.path.join(HERE, "feast_side.py"),
            "--workdir",
            workdir,
            "--store",
            store,
            *extra,
        ]

    def run(self, phase: str, tag: str, expect: str = "values") -> tuple[float, float]:
        """Wall and CPU seconds of Feast's calls."""
        out = timed([*self.base, "--phase", phase, "--tag", tag, "--expect", expect])[3]
        got = json.loads(out.strip().splitlines()[-1])
        return float(got["seconds"]), float(got["cpu_s"])


@contextmanager
def servers(stores: list[str]) -> Iterator[dict[str, Any]]:
    held: dict[str, Any] = {}
    try:
        if "postgres" in stores:
            pg = PostgresServer(fsync=True)
            pg.start()
            held["postgres"] = pg
        if "redis" in stores:
            rd = RedisServer()
            rd.start()
            held["redis"] = rd
        yield held
    finally:
        for server in held.values():
            server.close()


def store_url(kind: str, workdir: str, held: dict[str, Any], tag: str) -> str:
    if kind == "sqlite":
        return f"sqlite:///{os.path.join(workdir, f'deltarec-{tag}.db')}"
    if kind == "postgres":
        return f"{held['postgres'].url}?schema=deltarec_{tag}"
    return f"{held['redis'].url}?prefix=deltarec{tag}:"


def feast_args(kind: str, held: dict[str, Any]) -> list[str]:
    if kind == "postgres":
        pg = held["postgres"]
        return ["--port", str(pg.port), "--user", pg.user]
    if kind == "redis":
        return ["--port", str(held["redis"].port)]
    return []


def measure(a: argparse.Namespace, held: dict[str, Any], kinds: list[str], n: int, work: str):
    """Every phase of every store in ``kinds`` on ``n`` rows; returns one record per phase."""
    t = time.perf_counter()
    art = peer_rows.build(work, n, a.dim)
    print(f"# {n:,} rows built in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    ours = Deltarec(art)
    results: list[dict[str, Any]] = []

    def pair(
        kind: str, phase: str, rep: int, mine: Callable[[], Any], feast_phase: str | None
    ) -> None:
        """deltarec's process and Feast's phase (None: none), in alternating order."""
        peer = Feast(work, kind, feast_args(kind, held))
        expect = "update" if feast_phase == "update" else "values"
        rec: dict[str, Any] = {"store": kind, "phase": phase, "rows": n, "repeat": rep}
        for side in ("deltarec", "feast") if rep % 2 == 0 else ("feast", "deltarec"):
            if side == "deltarec":
                rec["deltarec_s"], rec["deltarec_cpu_s"], rec["deltarec_rss_mb"] = mine()
            elif not a.skip_feast and feast_phase is not None:
                rec["feast_s"], rec["feast_cpu_s"] = peer.run(feast_phase, f"r{rep}", expect)
        rec["load_avg"] = os.getloadavg()[0]
        print(f"# {json.dumps(rec)}", file=sys.stderr)
        results.append(rec)

    for kind in kinds:
        for rep in range(a.repeat):
            url = store_url(kind, work, held, f"r{rep}")
            pair(kind, "publish / write", rep, functools.partial(ours.publish, url), "load")
            pair(kind, "verify --all / read", rep, functools.partial(ours.verify, url), "read")
    peer_rows.write_update(work)
    for kind in kinds:
        for rep in range(a.repeat):
            url = store_url(kind, work, held, f"r{rep}")
            phase = "update" if a.feast_update else None
            pair(kind, "update all keys", rep, functools.partial(ours.publish, url), phase)
    return results


def table(results: list[dict[str, Any]]) -> str:
    """Markdown: rates by wall time, CPU seconds (the client process's), and the ratios."""
    lines = [
        "| store | rows | phase | deltarec rows/s (wall s, CPU s, peak RSS MB) "
        "| Feast rows/s (wall s, CPU s) | ratio (wall) | ratio (CPU) |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in results:
        ours = r["rows"] / r["deltarec_s"]
        mine = (
            f"{ours:,.0f} ({r['deltarec_s']:.2f}, {r['deltarec_cpu_s']:.2f}, "
            f"{r['deltarec_rss_mb']:.0f})"
        )
        peer, ratio, cpu = "-", "-", "-"
        if "feast_s" in r:
            theirs = r["rows"] / r["feast_s"]
            peer = f"{theirs:,.0f} ({r['feast_s']:.1f}, {r['feast_cpu_s']:.1f})"
            ratio = f"{ours / theirs:.1f}x"
            cpu = f"{r['feast_cpu_s'] / r['deltarec_cpu_s']:.1f}x"
        phase = f"{r['store']} | {r['rows']:,} | {r['phase']}"
        lines.append(f"| {phase} | {mine} | {peer} | {ratio} | {cpu} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stores", nargs="+", default=["sqlite", "postgres", "redis"])
    p.add_argument("--sqlite-rows", type=int, default=1_000_000)
    p.add_argument("--server-rows", type=int, default=500_000, help="PostgreSQL and Redis")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--skip-feast", action="store_true", help="deltarec's side only")
    p.add_argument(
        "--feast-update", action="store_true", help="Feast's update phase too (minutes more)"
    )
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    p.add_argument("--json", default=None, help="write every record here")
    a = p.parse_args()
    if not a.skip_feast and not os.path.exists(PEER_PYTHON):
        raise SystemExit(f"no {PEER_PYTHON}: run bench/peers/setup.sh first (installs Feast 0.67)")
    started = datetime.datetime.now(datetime.timezone.utc)
    base = tempfile.mkdtemp(prefix="deltarec-peers-", dir=a.dir)
    results: list[dict[str, Any]] = []
    try:
        with servers(a.stores) as held:
            groups = [(["sqlite"], a.sqlite_rows), (["postgres", "redis"], a.server_rows)]
            for kinds, n in groups:
                kinds = [k for k in kinds if k in a.stores]
                if kinds:
                    work = os.path.join(base, f"rows-{n}")
                    os.makedirs(work, exist_ok=True)
                    results += measure(a, held, kinds, n, work)
                    shutil.rmtree(work, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"date: {started:%Y-%m-%d %H:%M} UTC; machine: {platform.node()}, {os.cpu_count()} cores")
    print(f"python {platform.python_version()}; dim {a.dim} float32, random int64 keys")
    print()
    print(table(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"date": started.isoformat(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
