"""Redis: the server's CPU per row of a write in paced units, against the unthrottled write.

Under a read budget the Redis store writes a batch in units of ``unit_rows`` rows, each a
transaction of its own (:mod:`deltarec.stores.redis.paced`); without one, a batch of upserts
no guard can refuse is one ``MULTI``/``EXEC`` of plain ``HSET`` decided under ``WATCH``
(:mod:`deltarec.stores.redis.plain`), and under a budget each unit is written the same way
(until 2026-12 each unit was one script call that checked the guard on the server and then ran
``HSET``). Where the server's one command thread is what limits a
publish (a host of many cores), what a row costs it bounds the budgeted publish's rate.

For each unit size (``--units``, ``none`` = unthrottled, the baseline), in turn ``--repeat``
times, on a fresh server started as the test fixtures start them (its append-only file
fsynced each second): ``--rows`` rows of dim ``--dim`` are loaded, then rewritten at a newer
version in writes of ``--write-rows`` rows (the budget's 4 MB transactions), the way the
budget sets the store (``unit_rows``, ``server_timing``). Printed per write of all rows: the
rate, the server process's CPU per row (``/proc``: user + system, every thread), of it the
units' time per row (``EXEC`` and ``EVALSHA`` in ``INFO commandstats``: what the budget sizes
the units by), and the wall time per row; then each unit
size's mean server CPU per row as a ratio to the baseline's.

Run: ``.venv/bin/python bench/bench_redis_units.py [--rows 400000] [--dim 64]
[--units none,1000,256,64,16] [--repeat 2] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

from deltarec.artifacts import TableSpec
from deltarec.stores import open_store
from deltarec.stores.redis.paced import server_usec
from deltarec.stores.types import RowBatch, Write
from deltarec.testing.servers import RedisServer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import provenance

TABLE = "sparse.ebc.item_id"


def _cpu_s(pid: int) -> float:
    """User + system seconds of process ``pid`` (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one(unit: int | None, rows: int, dim: int, write_rows: int) -> dict[str, Any]:
    """Load ``rows`` rows, rewrite them in units of ``unit`` rows (None: unthrottled)."""
    rng = np.random.default_rng(0)
    keys = rng.permutation(rows * 4)[:rows].astype(np.int64)
    emb = rng.standard_normal((rows, dim), np.float32)
    ops = np.zeros(rows, np.int8)
    server = RedisServer()
    server.start()
    try:
        assert server.proc is not None
        store = open_store(f"{server.url}?prefix=units:", run="bench")
        store.provision({TABLE: TableSpec(dim=dim, num_embeddings=rows * 4)})
        store.apply(Write(TABLE, [RowBatch(keys, emb, ops, np.full(rows, 1 << 32, np.int64))]))
        store.unit_rows = unit  # type: ignore[attr-defined]
        store.server_timing = unit is not None  # type: ignore[attr-defined]
        client = store._client  # type: ignore[attr-defined]
        units0, cpu0, t0 = server_usec(client), _cpu_s(server.proc.pid), time.perf_counter()
        version = np.full(write_rows, 2 << 32, np.int64)
        for s in range(0, rows, write_rows):
            k = slice(s, s + write_rows)
            n = len(keys[k])
            store.apply(Write(TABLE, [RowBatch(keys[k], emb[k], ops[k], version[:n])]))
        wall = time.perf_counter() - t0
        cpu = _cpu_s(server.proc.pid) - cpu0
        units = (server_usec(client) or 0) - (units0 or 0)
        got = store.read(TABLE, keys[::97])
        assert got.found.all() and (got.versions == 2 << 32).all()  # every row rewritten
        store.close()
    finally:
        server.close()  # stopped, and its data folder removed
    return {
        "unit_rows": unit,
        "rows_per_s": round(rows / wall),
        "server_cpu_us_per_row": round(cpu * 1e6 / rows, 3),
        "units_us_per_row": round(units / rows, 3) if unit else None,
        "wall_us_per_row": round(wall * 1e6 / rows, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=400_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--units", default="none,1000,256,64,16")
    p.add_argument("--write-rows", type=int, default=16_000, help="rows a write (~4 MB)")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    units = [None if u == "none" else int(u) for u in args.units.split(",")]
    commit = provenance.commit()
    print(
        provenance.header("bench_redis_units", commit) + f", {args.rows:,} rows dim "
        f"{args.dim}, writes of {args.write_rows:,} rows"
    )
    runs = []
    for i in range(args.repeat):
        for unit in units:
            r = one(unit, args.rows, args.dim, args.write_rows)
            runs.append(r)
            print(
                f"#{i + 1} units {unit or 'none':>5}: {r['rows_per_s']:>9,} rows/s, server cpu "
                f"{r['server_cpu_us_per_row']:.2f} us/row (units {r['units_us_per_row']}),"
                f" wall {r['wall_us_per_row']:.2f} us/row",
                flush=True,
            )
    base = np.mean([r["server_cpu_us_per_row"] for r in runs if r["unit_rows"] is None])
    for unit in units:
        mine = [r for r in runs if r["unit_rows"] == unit]
        cpu = np.mean([r["server_cpu_us_per_row"] for r in mine])
        rate = np.mean([r["rows_per_s"] for r in mine])
        print(
            f"units {unit or 'none':>5}: server cpu {cpu:.2f} us/row = {cpu / base:.2f}x the "
            f"unthrottled write's; {rate:,.0f} rows/s"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "commit": commit, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
