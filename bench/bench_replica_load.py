"""Benchmark: the replica's HTTP server (uvicorn) against the stdlib server it replaced.

Serves one table (``rows`` keys x ``dim`` float32, a snapshot) from one replica through both
servers in this process, one at a time, and drives each from a separate load process: ``C``
keep-alive connections, each sending its next request as soon as the last answer is read,
for ``seconds``. Workloads (``--cases``, ``workload:C``): ``lookupN``, ``POST /v1/lookup`` of
N random held ids (JSON, the online shape; ``lookup1`` is mostly the transport's own cost) and
``rows``, ``POST /v1/rows`` of 1024 keys (binary, verify's readback). Reported per server and
case: requests/s, latency p50/p99, the server's CPU per request (this process's CPU time over
the requests: the load-independent cost), errors and dropped connections; rounds alternate
the servers so both see the same load on a shared machine.

The baseline is ``src/deltarec/serving/http.py`` as of commit :data:`STDLIB_COMMIT` (stdlib
``ThreadingHTTPServer``, one thread per connection), loaded from git into a temporary module:
it is not kept in the package.

usage: .venv/bin/python bench/bench_replica_load.py [--rows N] [--dim D] [--seconds S]
           [--cases lookup1:16,lookup16:1,lookup16:16,lookup16:64,rows:16] [--rounds R]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

STDLIB_COMMIT = "85a87b74d4c91cf341d4709db665feefac9e9a0c"
"""The last commit whose ``serving/http.py`` is the stdlib server."""
RUN, TABLE = "bench", "sparse.ebc.item_id"
HERE = os.path.dirname(os.path.abspath(__file__))


# ---- the load process ------------------------------------------------------------------------
async def _connection(port: int, requests: list[bytes], until: float, out: dict) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    loop, i = asyncio.get_running_loop(), 0
    try:
        while loop.time() < until:
            t0 = time.perf_counter()
            writer.write(requests[i % len(requests)])
            i += 1
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            await reader.readexactly(length)
            out["lat"].append(time.perf_counter() - t0)
            if status != 200:
                out["errors"] += 1
    except (OSError, asyncio.IncompleteReadError):
        out["dropped"] += 1
    finally:
        writer.close()


async def _drive(port: int, requests: list[bytes], concurrency: int, seconds: float) -> dict:
    out: dict[str, Any] = {"lat": [], "errors": 0, "dropped": 0}
    until = asyncio.get_running_loop().time() + seconds
    await asyncio.gather(*(_connection(port, requests, until, out) for _ in range(concurrency)))
    return out


def _client(argv: list[str]) -> None:
    port, workload, concurrency, seconds, rows = argv[0], argv[1], *map(float, argv[2:5])
    rng = np.random.default_rng(int(concurrency))
    requests = []
    for _ in range(256):
        if workload.startswith("lookup"):
            ids = rng.integers(0, int(rows), int(workload[6:] or 16)).tolist()
            body = json.dumps({"table": TABLE, "ids": ids}).encode()
            path = "/v1/lookup"
        else:
            body = rng.integers(0, int(rows), 1024).astype("<i8").tobytes()
            path = f"/v1/rows?table={TABLE}"
        head = f"POST {path} HTTP/1.1\r\nHost: b\r\nContent-Length: {len(body)}\r\n\r\n"
        requests.append(head.encode() + body)
    t0 = time.perf_counter()
    out = asyncio.run(_drive(int(port), requests, int(concurrency), seconds))
    lat = sorted(out["lat"])
    n = len(lat)
    print(
        json.dumps(
            {
                "requests": n,
                "rps": n / (time.perf_counter() - t0),
                "p50_ms": 1e3 * lat[n // 2] if n else None,
                "p99_ms": 1e3 * lat[min(n - 1, int(n * 0.99))] if n else None,
                "errors": out["errors"],
                "dropped": out["dropped"],
            }
        )
    )


# ---- the servers -----------------------------------------------------------------------------
def _stdlib_module(tmp: str) -> Any:
    """The stdlib server module as of :data:`STDLIB_COMMIT` (from git, into ``tmp``)."""
    text = subprocess.run(
        ["git", "-C", HERE, "show", f"{STDLIB_COMMIT}:src/deltarec/serving/http.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = os.path.join(tmp, "deltarec_stdlib_http.py")
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location("deltarec_stdlib_http", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _replica(root_dir: str, rows: int, dim: int) -> Any:
    from deltarec.artifacts import ArtifactRoot, DType, DumpKind, ShardRows, TableSpec, write_dump
    from deltarec.serving.follow import FixedPointer, Follower
    from deltarec.serving.replica import Replica
    from deltarec.stores.types import ServingPointer
    from deltarec.testing.dumps import new_generation

    root = ArtifactRoot(root_dir)
    spec = TableSpec(dim=dim, dtype=DType.FLOAT32, num_embeddings=rows)
    info = new_generation(root, RUN, {TABLE: spec}, world_size=1)
    rng = np.random.default_rng(0)
    shard = ShardRows(
        np.arange(rows, dtype=np.int64),
        rng.standard_normal((rows, dim), np.float32),
        np.zeros(rows, np.int8),
        np.zeros(rows, np.int64),
    )
    write_dump(root, info, 0, DumpKind.SNAPSHOT, {TABLE: {0: shard}}, 0, 0)
    follower = Follower(Replica(root, RUN), FixedPointer(ServingPointer(RUN, 1, 0, 1.0)))
    follower.poll()
    return follower


def _measure(port: int, workload: str, concurrency: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--client", str(port), workload, str(concurrency)]
    cmd += [str(args.seconds), str(args.rows)]
    cpu = time.process_time()
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    out["server_cpu_us"] = 1e6 * (time.process_time() - cpu) / max(1, out["requests"])
    return out  # type: ignore[no-any-return]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        _client(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--cases", default="lookup1:16,lookup16:1,lookup16:16,lookup16:64,rows:16")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()

    import torch

    from deltarec.serving.http import ReplicaServer

    commit = subprocess.run(
        ["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(
        f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; commit {commit}"
    )
    print(f"machine: {platform.node()} {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")  # fmt: skip
    print(f"table {args.rows} x {args.dim} float32; {args.seconds:g} s per measurement")
    with tempfile.TemporaryDirectory() as tmp:
        follower = _replica(os.path.join(tmp, "art"), args.rows, args.dim)
        stdlib = _stdlib_module(tmp)
        servers = {
            "uvicorn": lambda: ReplicaServer(follower),
            "stdlib": lambda: stdlib.ReplicaServer(follower),
        }
        cases = [(w, int(c)) for w, c in (case.split(":") for case in args.cases.split(","))]
        results: dict[tuple[str, str, int], list[dict]] = {}
        for r in range(args.rounds):
            for name in servers if r % 2 == 0 else reversed(list(servers)):
                with servers[name]() as server:
                    for workload, c in cases:
                        res = _measure(server.port, workload, c, args)
                        results.setdefault((name, workload, c), []).append(res)
                        print(
                            f"round {r} {name:8s} {workload:8s} C={c:3d}: {_fmt(res)}", flush=True
                        )
        print("\nbest round per case; ratio = uvicorn / stdlib requests/s")
        for workload, c in cases:
            new = max(results[("uvicorn", workload, c)], key=lambda x: x["rps"])
            old = max(results[("stdlib", workload, c)], key=lambda x: x["rps"])
            print(f"{workload:8s} C={c:3d}  uvicorn {_fmt(new)}  |  stdlib {_fmt(old)}  |  "
                  f"ratio {new['rps'] / old['rps']:.2f}")  # fmt: skip


def _fmt(r: dict) -> str:
    return (
        f"{r['rps']:8.0f} req/s p50 {r['p50_ms']:.2f} ms p99 {r['p99_ms']:.2f} ms "
        f"server CPU {r['server_cpu_us']:.0f} us/req errors {r['errors']} dropped {r['dropped']}"
    )


if __name__ == "__main__":
    main()
