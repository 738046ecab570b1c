"""Costs follow the table (issue 43 item 5): the two modes of ``bench_history.py`` that time one
command against its baseline in the same process, pair by pair.

``--backlog``: D deltas of 2,000 random keys over a 200k-row dim-16 table (one rank, a snapshot
published first), published as a backlog into a copy of the snapshot's store; the baseline is
one delta holding as many distinct keys as the backlog has rows (at most the table) of a second
run in the same root, published into a copy of its own snapshot's store (``--store postgres`` or
``redis``: a fresh schema or key prefix on a throwaway server each time, the snapshot
published into it untimed first). Ratio: the backlog's
rows/s (D x 2,000 rows) over the one dump's. Each repeat times both, alternating which goes
first, after one uncounted pair.

``--shards``: the same 900k rows of dim 16 in 20 tables, written as one snapshot dump of 256
ranks (5,120 shards) and of 2 ranks (40 shards) in two runs; ``publish`` into a fresh SQLite
store, ``verify --all`` and ``verify`` (sampled) of each, alternating. Ratio: many shards over
few.

Artifacts are written once into ``--workdir`` and reused by later invocations (a marker file),
so the same artifacts can be timed under two versions of the code, alternating.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from deltarec.artifacts import ArtifactRoot, DumpKind, TableSpec
from deltarec.cli import main
from deltarec.testing.dumps import new_generation, random_rows, write_dump

TABLE = "sparse.ebc.user_id"
ROWS, DIM, KEYS_PER_DUMP = 200_000, 16, 2_000
SHARD_TABLES, SHARD_ROWS = 20, 45_000  # 900k rows in 20 tables


def _run(argv: list[str]) -> float:
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rc = main(argv)
    if rc != 0:
        raise SystemExit(f"{' '.join(argv[:1])} failed with {rc}")
    return time.perf_counter() - t0


def _publish(art: str, run: str, db: Path) -> float:
    return _run(["publish", "--artifacts", art, "--run", run, "--store", f"sqlite:///{db}"])


def _write_backlog(work: Path, dumps: int) -> tuple[str, Path, Path]:
    """The two runs and their stores with the snapshot published (written once)."""
    art = work / f"backlog-d{dumps}"
    base_a, base_b = art / "backlog.db", art / "one.db"
    if (art / "WRITTEN").exists():
        return str(art), base_a, base_b
    shutil.rmtree(art, ignore_errors=True)
    root = ArtifactRoot(str(art))
    spec = TableSpec(dim=DIM, num_embeddings=ROWS)
    snap = random_rows(np.arange(ROWS), spec, seed=0, step=0)
    for run, db in (("backlog", base_a), ("one", base_b)):
        info = new_generation(root, run, {TABLE: spec}, world_size=1)
        write_dump(root, info, 0, {TABLE: {0: snap}}, kind=DumpKind.SNAPSHOT, first_step=0)
        _publish(str(art), run, db)
    info = root.read_generation("backlog", 1)
    rng = np.random.default_rng(1)
    for seq in range(1, dumps + 1):
        keys = np.unique(rng.integers(0, ROWS, KEYS_PER_DUMP))
        rows = random_rows(keys, spec, seed=seq, step=seq)
        write_dump(root, info, seq, {TABLE: {0: rows}}, first_step=seq, last_step=seq)
    distinct = min(dumps * KEYS_PER_DUMP, ROWS)
    keys = np.sort(np.random.default_rng(2).choice(ROWS, distinct, replace=False))
    one = root.read_generation("one", 1)
    write_dump(root, one, 1, {TABLE: {0: random_rows(keys, spec, seed=3, step=1)}})
    (art / "WRITTEN").write_text("")
    return str(art), base_a, base_b


def _snapshots_only(work: Path, dumps: int) -> str:
    """A copy of the backlog root without the dumps after each run's snapshot (written once)."""
    src, out = work / f"backlog-d{dumps}", work / f"backlog-d{dumps}-snapshots"
    if (out / "WRITTEN").exists():
        return str(out)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(
        src,
        out,
        ignore=lambda d, names: [
            n for n in names if (n.startswith("dump-") and n != "dump-000000") or n.endswith(".db")
        ],
    )
    (out / "WRITTEN").write_text("")
    return str(out)


def _pairs(
    repeat: int, a: Callable[[], float], b: Callable[[], float]
) -> tuple[list[float], list[float]]:
    """``repeat`` times each of ``a`` and ``b``, alternating which goes first, after one
    uncounted pair (the process's first imports and page-cache reads)."""
    a(), b()
    ta, tb = [], []
    for i in range(repeat):
        if i % 2:
            tb.append(b())
            ta.append(a())
        else:
            ta.append(a())
            tb.append(b())
    return ta, tb


def backlog(
    work: Path, dumps: int, repeat: int, fresh_store: Callable[[], str] | None = None
) -> dict[str, object]:
    """The backlog publish against one dump of the same distinct keys (module docstring).

    ``fresh_store``: a new empty store's URL per call (PostgreSQL, Redis); each publish then
    first gets the snapshot, untimed, from a root holding only the snapshots. Without it, the
    SQLite stores with the snapshot published are copied.
    """
    art, base_a, base_b = _write_backlog(work, dumps)
    rows, distinct = dumps * KEYS_PER_DUMP, min(dumps * KEYS_PER_DUMP, ROWS)

    def timed(run: str, base: Path) -> Callable[[], float]:
        def go() -> float:
            if fresh_store is not None:
                url = fresh_store()
                snap = _snapshots_only(work, dumps)
                _run(["publish", "--artifacts", snap, "--run", run, "--store", url])
                return _run(["publish", "--artifacts", art, "--run", run, "--store", url])
            db = base.with_name(f"{run}-copy.db")
            shutil.copy(base, db)
            try:
                return _publish(art, run, db)
            finally:
                db.unlink()

        return go

    ta, tb = _pairs(repeat, timed("backlog", base_a), timed("one", base_b))
    ratios = [(rows / a) / (distinct / b) for a, b in zip(ta, tb, strict=True)]
    return {
        "mode": "backlog",
        "dumps": dumps,
        "backlog_s": [round(t, 3) for t in ta],
        "one_dump_s": [round(t, 3) for t in tb],
        "backlog_over_one_dump": [round(r, 3) for r in ratios],
        "median": round(statistics.median(ratios), 3),
    }


def _write_shards(work: Path, ranks: int) -> str:
    """One snapshot of the 20 tables over ``ranks`` ranks (row-wise), written once."""
    art = work / f"shards-{ranks}"
    if (art / "WRITTEN").exists():
        return str(art)
    shutil.rmtree(art, ignore_errors=True)
    root = ArtifactRoot(str(art))
    specs = {
        f"sparse.ebc.t{t:02d}": TableSpec(dim=DIM, num_embeddings=SHARD_ROWS, sharding="row_wise")
        for t in range(SHARD_TABLES)
    }
    info = new_generation(root, "shards", specs, world_size=ranks)
    parts = np.array_split(np.arange(SHARD_ROWS, dtype=np.int64), ranks)
    rows = {
        table: {r: random_rows(keys, spec, seed=t) for r, keys in enumerate(parts)}
        for t, (table, spec) in enumerate(specs.items())
    }
    write_dump(root, info, 0, rows, kind=DumpKind.SNAPSHOT, first_step=0)
    (art / "WRITTEN").write_text("")
    return str(art)


def shards(work: Path, many: int, few: int, repeat: int) -> dict[str, object]:
    """``publish``, ``verify --all`` and ``verify`` of the same rows as ``many`` and ``few`` shards
    a table."""
    arts = {n: _write_shards(work, n) for n in (many, few)}
    whats = ("publish", "verify_all", "verify_sampled")
    times: dict[int, dict[str, list[float]]] = {n: {w: [] for w in whats} for n in arts}

    def both(n: int) -> Callable[[], float]:
        def go() -> float:
            db = work / f"shards-{n}.db"
            db.unlink(missing_ok=True)
            times[n]["publish"].append(_publish(arts[n], "shards", db))
            url = f"sqlite:///{db}"
            argv = ["verify", "--artifacts", arts[n], "--run", "shards", "--store", url]
            times[n]["verify_all"].append(_run([*argv, "--all", "--no-record"]))
            times[n]["verify_sampled"].append(_run([*argv, "--no-record"]))
            db.unlink()
            return 0.0

        return go

    _pairs(repeat, both(many), both(few))
    for n in arts:  # the uncounted first pair
        for what in times[n]:
            del times[n][what][0]
    out: dict[str, object] = {"mode": "shards", "shards": {n: n * SHARD_TABLES for n in arts}}
    for what in whats:
        ratios = [m / f for m, f in zip(times[many][what], times[few][what], strict=True)]
        out[what] = {
            f"{many}_ranks_s": [round(t, 3) for t in times[many][what]],
            f"{few}_ranks_s": [round(t, 3) for t in times[few][what]],
            "many_over_few": [round(r, 2) for r in ratios],
            "median": round(statistics.median(ratios), 2),
        }
    return out
