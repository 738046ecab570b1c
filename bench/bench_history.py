"""A run's history (SPEC §3a): every command's time against the number of dumps, before and after
compaction and gc.

One 200k-row dim-16 table: a snapshot (published at once), then D deltas of 2,000 random keys
(one rank), written with the artifacts API. For each D, on a SQLite store: ``publish`` of the
backlog of deltas, ``verify`` (sampled), ``verify --all``, ``inspect``; then ``compact`` and
``gc``, and the same commands again into a fresh store (publish starts it from the base). The
baseline of the backlog publish is one more delta of as many distinct keys as the backlog has
rows (at most the table), published right after it into the same store (rows/s). Artifact
bytes on disk before and after gc. Times are of the CLI's ``main`` in this process.

With ``--s3`` the artifact root is on a throwaway SeaweedFS (``deltarec.testing.servers``,
credentials and endpoint through ``AWS_*`` variables as a user would give them) and each
command's S3 requests are counted (s3fs's calls, by this process). ``--rounds N`` times the
commands after compaction N more times over every D in turn, so that D = 5,000 and D = 50
are compared under the same load.

    python bench/bench_history.py [--dumps 50 500] [--s3] [--rounds N] [--workdir DIR] [--json PATH]

``--backlog`` and ``--shards`` time the costs that must follow the table (the backlog publish
against one dump of the same keys; 5,120 shards against 40), each pair in this process
(``bench/history_costs.py``):

    python bench/bench_history.py --backlog --dumps 50 500 --repeat 5 --workdir DIR
    python bench/bench_history.py --shards 256 2 --repeat 3 --workdir DIR
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

from deltarec.artifacts import ArtifactRoot, DumpKind, TableSpec
from deltarec.cli import main
from deltarec.testing.dumps import new_generation, random_rows, write_dump

RUN, TABLE = "hist", "sparse.ebc.user_id"
ROWS, DIM, KEYS_PER_DUMP = 200_000, 16, 2_000


def _write(root: ArtifactRoot, dumps: int, store: str) -> int:
    """The snapshot (published into ``store`` at once), then the deltas (a backlog)."""
    spec = TableSpec(dim=DIM, num_embeddings=ROWS)
    info = new_generation(root, RUN, {TABLE: spec}, world_size=1)
    snap = random_rows(np.arange(ROWS), spec, seed=0, step=0)
    write_dump(root, info, 0, {TABLE: {0: snap}}, kind=DumpKind.SNAPSHOT, first_step=0, last_step=0)
    _timed(["publish", "--artifacts", root.uri, "--run", RUN, "--store", store])
    rng = np.random.default_rng(1)
    for seq in range(1, dumps + 1):
        keys = np.unique(rng.integers(0, ROWS, KEYS_PER_DUMP))
        rows = random_rows(keys, spec, seed=seq, step=seq)
        write_dump(root, info, seq, {TABLE: {0: rows}}, first_step=seq, last_step=seq)
        if seq % 500 == 0:
            print(f"# {seq} of {dumps} dumps written", file=sys.stderr, flush=True)
    return info.generation


def _one_dump(root: ArtifactRoot, seq: int, rows: int) -> None:
    """One more delta of the run holding ``rows`` distinct keys: the backlog's baseline."""
    info = root.read_generation(RUN, 1)
    spec = info.tables[TABLE]
    keys = np.sort(np.random.default_rng(2).choice(ROWS, rows, replace=False))
    rows_ = random_rows(keys, spec, seed=3, step=seq)
    write_dump(root, info, seq, {TABLE: {0: rows_}}, first_step=seq, last_step=seq)


REQUESTS: list[int] = [0]
"""S3 requests made so far (counted only with ``--s3``)."""


def _count_s3_requests() -> None:
    import s3fs

    call = s3fs.S3FileSystem._call_s3

    async def counted(self, method, *args, **kwargs):  # type: ignore[no-untyped-def]
        REQUESTS[0] += 1
        return await call(self, method, *args, **kwargs)

    s3fs.S3FileSystem._call_s3 = counted


def _timed(argv: list[str]) -> float:
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rc = main(argv)
    if rc not in (0, 1):
        raise SystemExit(f"{argv[0]} failed with {rc}")
    return time.perf_counter() - t0


def _counted(out: dict[str, float], name: str, argv: list[str]) -> float:
    """Time ``argv`` into ``out[name]``, with its S3 requests (if any) in ``name_requests``."""
    before = REQUESTS[0]
    out[name] = seconds = round(_timed(argv), 3)
    if REQUESTS[0] != before:
        out[f"{name}_requests"] = REQUESTS[0] - before
    return seconds


def _bytes(root: ArtifactRoot) -> int:
    if root.is_local:
        return sum(f.stat().st_size for f in Path(root.path).rglob("*") if f.is_file())
    root.fs.invalidate_cache()
    return int(root.fs.du(root.path))


def _kept(root: ArtifactRoot, generation: int) -> dict[str, int]:
    """What gc left: the newest base's bytes (its parts), and the dumps kept (the window)."""
    from deltarec.artifacts.base import list_bases, read_base

    root.fs.invalidate_cache()
    bases = list_bases(root, RUN)
    base = read_base(root, RUN, *bases[-1]) if bases else None
    return {
        "bases_kept": len(bases),
        "base_bytes": sum(p.bytes for p in base.parts) if base else 0,
        "dumps_kept": len(root.committed_seqs(RUN, generation)),
    }


def _commands(art: str, url: str, run: str = RUN) -> dict[str, float]:
    loc = ["--artifacts", art, "--run", run]
    out: dict[str, float] = {}
    for name, argv in (
        ("publish", ["publish", *loc, "--store", url]),
        ("verify", ["verify", *loc, "--store", url, "--no-record"]),
        ("verify_all", ["verify", *loc, "--store", url, "--all", "--no-record"]),
        ("inspect", ["inspect", *loc, "--json"]),
    ):
        _counted(out, name, argv)
    return out


def one(dumps: int, work: Path, s3_uri: str | None = None) -> dict[str, object]:
    art = s3_uri or str(work / f"d{dumps}")
    root = ArtifactRoot(art)
    store = f"sqlite:///{work / f'd{dumps}-a.db'}"
    t0 = time.perf_counter()
    generation = _write(root, dumps, store)
    written = time.perf_counter() - t0
    rows = dumps * KEYS_PER_DUMP  # the backlog's rows (the snapshot was published before)
    before = _commands(art, store)
    distinct = min(rows, ROWS)
    _one_dump(root, dumps + 1, distinct)
    loc = ["--artifacts", art, "--run", RUN]
    one_s = _counted(before, "publish_one_dump", ["publish", *loc, "--store", store])
    size_before = _bytes(root)
    upkeep: dict[str, float] = {}
    compact_s = _counted(upkeep, "compact", ["compact", *loc])
    gc_s = _counted(upkeep, "gc", ["gc", *loc, "--store", store])
    after = _commands(art, f"sqlite:///{work / f'd{dumps}-b.db'}")
    backlog_rate = rows / before["publish"]
    return {
        "dumps": dumps,
        "artifacts": art,
        "write_s": round(written, 2),
        "root": "s3" if s3_uri else "local",
        "before": before,
        "compact_s": round(compact_s, 3),
        "gc_s": round(gc_s, 3),
        **{f"{k}": v for k, v in upkeep.items() if k.endswith("_requests")},
        "after": after,
        "bytes_before": size_before,
        "bytes_after": _bytes(root),
        **_kept(root, generation),
        "backlog_rows_per_s": round(backlog_rate),
        "one_dump_rows_per_s": round(distinct / one_s),
        "backlog_over_one_dump": round(backlog_rate / (distinct / one_s), 3),
    }


def _rounds(results: list[dict], work: Path, rounds: int) -> dict[int, dict[str, list[float]]]:
    """The commands after compaction again, ``rounds`` times over every D in turn (each into a
    fresh store), so that D = 5,000 and D = 50 are timed alternately under the same load."""
    out: dict[int, dict[str, list[float]]] = {r["dumps"]: {} for r in results}
    for i in range(rounds):
        for r in results if i % 2 == 0 else results[::-1]:
            db = work / f"d{r['dumps']}-round{i}-{len(results)}.db"
            for name, value in _commands(r["artifacts"], f"sqlite:///{db}").items():
                out[r["dumps"]].setdefault(name, []).append(value)
    return out


def main_() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dumps", type=int, nargs="+", default=[50, 500])
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--s3", action="store_true", help="the artifact root on SeaweedFS")
    ap.add_argument("--backlog", action="store_true", help="backlog vs one dump, pair by pair")
    ap.add_argument("--shards", type=int, nargs=2, metavar=("MANY", "FEW"), default=None)
    ap.add_argument(
        "--store", choices=["sqlite", "postgres", "redis"], default="sqlite", help="--backlog's"
    )
    ap.add_argument("--repeat", type=int, default=3, help="pairs timed (--backlog, --shards)")
    ap.add_argument(
        "--rounds", type=int, default=0, help="after compact + gc: rounds over every D, alternating"
    )
    args = ap.parse_args()
    if args.backlog or args.shards:
        _costs(args)
        return
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-history-"))
    work.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    results: list[dict] = []
    rounds: dict[int, dict[str, list[float]]] = {}
    with contextlib.ExitStack() as stack:
        s3 = None
        if args.s3:
            from deltarec.testing.servers import SeaweedServer

            s3 = stack.enter_context(SeaweedServer(volume_max=1000))  # 32 GB: D = 5,000 fits
            os.environ.update(
                AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test", AWS_ENDPOINT_URL=s3.endpoint
            )
            _count_s3_requests()
        try:
            for d in args.dumps:
                r = one(d, work, s3.fresh_uri()[0] if s3 is not None else None)
                print(json.dumps(r), flush=True)
                results.append(r)
            rounds = _rounds(results, work, args.rounds)
            if rounds:
                print(json.dumps({"rounds": rounds}), flush=True)
        finally:
            if args.workdir is None:
                shutil.rmtree(work, ignore_errors=True)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "commit": commit,
        "cpus": os.cpu_count(),
        "results": results,
        "rounds": rounds,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


def _costs(args: argparse.Namespace) -> None:
    import history_costs

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-history-"))
    work.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, object]] = []
    stack = contextlib.ExitStack()
    try:
        if args.backlog:
            fresh = _fresh_stores(stack, args.store)
            for d in args.dumps:
                results.append(history_costs.backlog(work, d, args.repeat, fresh))
                results[-1]["store"] = args.store
                print(json.dumps(results[-1]), flush=True)
        if args.shards:
            results.append(history_costs.shards(work, *args.shards, args.repeat))
            print(json.dumps(results[-1]), flush=True)
    finally:
        stack.close()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def _fresh_stores(stack: contextlib.ExitStack, kind: str) -> Callable[[], str] | None:
    """A new empty store's URL per call on a throwaway server of ``kind`` (None: SQLite)."""
    if kind == "sqlite":
        return None
    from deltarec.testing.servers import PostgresServer, RedisServer

    if kind == "postgres":
        pg = stack.enter_context(PostgresServer())
        return lambda: f"{pg.url}?schema=b{uuid.uuid4().hex[:10]}"
    redis = stack.enter_context(RedisServer())
    return lambda: f"{redis.url}?prefix=b{uuid.uuid4().hex[:10]}:"


if __name__ == "__main__":
    main_()
