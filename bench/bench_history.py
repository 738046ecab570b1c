"""A run's history (SPEC §3a): every command's time against the number of dumps, before and after
compaction and gc.

One 200k-row dim-16 table: a snapshot (published at once), then D deltas of 2,000 random keys
(one rank), written with the artifacts API. For each D, on a SQLite store: ``publish`` of the
backlog of deltas, ``verify`` (sampled), ``verify --all``, ``inspect``; then ``compact`` and
``gc``, and the same commands again into a fresh store (publish starts it from the base). The
baseline of the backlog publish is one more delta of as many distinct keys as the backlog has
rows (at most the table), published right after it into the same store (rows/s). Artifact
bytes on disk before and after gc. Times are of the CLI's ``main`` in this process.

    python bench/bench_history.py [--dumps 50 500] [--workdir DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import subprocess
import tempfile
import time
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
    return info.generation


def _one_dump(root: ArtifactRoot, seq: int, rows: int) -> None:
    """One more delta of the run holding ``rows`` distinct keys: the backlog's baseline."""
    info = root.read_generation(RUN, 1)
    spec = info.tables[TABLE]
    keys = np.sort(np.random.default_rng(2).choice(ROWS, rows, replace=False))
    rows_ = random_rows(keys, spec, seed=3, step=seq)
    write_dump(root, info, seq, {TABLE: {0: rows_}}, first_step=seq, last_step=seq)


def _timed(argv: list[str]) -> float:
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rc = main(argv)
    if rc not in (0, 1):
        raise SystemExit(f"{argv[0]} failed with {rc}")
    return time.perf_counter() - t0


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _commands(art: str, url: str, run: str = RUN) -> dict[str, float]:
    loc = ["--artifacts", art, "--run", run]
    return {
        "publish": _timed(["publish", *loc, "--store", url]),
        "verify": _timed(["verify", *loc, "--store", url, "--no-record"]),
        "verify_all": _timed(["verify", *loc, "--store", url, "--all", "--no-record"]),
        "inspect": _timed(["inspect", *loc, "--json"]),
    }


def one(dumps: int, work: Path) -> dict[str, object]:
    art = work / f"d{dumps}"
    root = ArtifactRoot(str(art))
    store = f"sqlite:///{work / f'd{dumps}-a.db'}"
    t0 = time.perf_counter()
    _write(root, dumps, store)
    written = time.perf_counter() - t0
    rows = dumps * KEYS_PER_DUMP  # the backlog's rows (the snapshot was published before)
    before = _commands(str(art), store)
    distinct = min(rows, ROWS)
    _one_dump(root, dumps + 1, distinct)
    one_s = _timed(["publish", "--artifacts", str(art), "--run", RUN, "--store", store])
    size_before = _bytes(art)
    compact_s = _timed(["compact", "--artifacts", str(art), "--run", RUN])
    gc_s = _timed(["gc", "--artifacts", str(art), "--run", RUN, "--store", store])
    after = _commands(str(art), f"sqlite:///{work / f'd{dumps}-b.db'}")
    backlog_rate = rows / before["publish"]
    return {
        "dumps": dumps,
        "write_s": round(written, 2),
        "before": {k: round(v, 3) for k, v in before.items()},
        "compact_s": round(compact_s, 3),
        "gc_s": round(gc_s, 3),
        "after": {k: round(v, 3) for k, v in after.items()},
        "bytes_before": size_before,
        "bytes_after": _bytes(art),
        "backlog_rows_per_s": round(backlog_rate),
        "one_dump_rows_per_s": round(distinct / one_s),
        "backlog_over_one_dump": round(backlog_rate / (distinct / one_s), 3),
    }


def main_() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dumps", type=int, nargs="+", default=[50, 500])
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-history-"))
    work.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    results = []
    try:
        for d in args.dumps:
            r = one(d, work)
            print(json.dumps(r))
            results.append(r)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "commit": commit,
        "cpus": os.cpu_count(),
        "results": results,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main_()
