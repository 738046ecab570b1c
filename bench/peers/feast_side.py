"""Feast's side of a peer pair: write the rows to its online store, read them back by key.

Runs in the peers' own virtual environment (``bench/peers/.venv``, Feast 0.67, see
``bench/peers/setup.sh``), never in deltarec's. It reads ``rows.npz`` written by
:mod:`rows` (the same keys and values deltarec publishes), then, for one phase:

* ``load``: ``FeatureStore.write_to_online_store`` of every row (one entity ``item_id`` int64,
  one feature view ``item_emb`` with one ``Array(Float32)`` feature), from a pandas DataFrame
  per ``--write-rows`` rows, into a fresh online store;
* ``update``: the same keys again with the update values;
* ``read``: ``FeatureStore.get_online_features`` of every key, ``--read-rows`` keys per call,
  and a check that every value read equals the one written (the last phase's).

The DataFrame building is outside the timed part (the rows are given to Feast as it takes them);
the timed part is Feast's own call. Prints one JSON line: ``{"phase", "rows", "seconds",
"cpu_s"}`` (wall and this process's CPU seconds of the calls).

    bench/peers/.venv/bin/python bench/peers/feast_side.py --workdir W --store sqlite \\
        --phase load
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from typing import Any

import numpy as np
import pandas as pd
from feast import Entity, FeatureStore, FeatureView, Field, FileSource, ValueType
from feast.repo_config import RepoConfig
from feast.types import Array, Float32

VIEW = "item_emb"


def online_store(args: argparse.Namespace) -> dict[str, Any]:
    if args.store == "sqlite":
        return {"type": "sqlite", "path": os.path.join(args.workdir, f"feast-{args.tag}.db")}
    if args.store == "postgres":
        return {
            "type": "postgres",
            "host": "127.0.0.1",
            "port": args.port,
            "database": "postgres",
            "db_schema": f"feast_{args.tag}",
            "user": args.user,
            "password": "",
            "sslmode": "disable",
        }
    return {"type": "redis", "connection_string": f"127.0.0.1:{args.port}"}


def feature_store(args: argparse.Namespace) -> tuple[FeatureStore, FeatureView]:
    repo = os.path.join(args.workdir, f"feast-{args.store}-{args.tag}")
    os.makedirs(repo, exist_ok=True)
    config = RepoConfig(
        project=f"peer_{args.tag}",
        registry=os.path.join(repo, "registry.db"),
        provider="local",
        online_store=online_store(args),
        entity_key_serialization_version=3,
    )
    store = FeatureStore(config=config, repo_path=repo)
    item = Entity(name="item", join_keys=["item_id"], value_type=ValueType.INT64)
    source = FileSource(path=os.path.join(repo, "unused.parquet"), timestamp_field="ts")
    view = FeatureView(
        name=VIEW,
        entities=[item],
        schema=[Field(name="embedding", dtype=Array(Float32))],
        source=source,
        online=True,
    )
    store.apply([item, view])
    return store, view


def frames(keys: np.ndarray, values: np.ndarray, size: int, ts: datetime.datetime) -> list:
    out = []
    for lo in range(0, len(keys), size):
        k = keys[lo : lo + size]
        out.append(
            pd.DataFrame(
                {
                    "item_id": k,
                    "embedding": list(values[lo : lo + size]),
                    "ts": [ts] * len(k),
                }
            )
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True)
    p.add_argument("--store", choices=("sqlite", "postgres", "redis"), required=True)
    p.add_argument("--phase", choices=("load", "update", "read"), required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--user", default="postgres")
    p.add_argument("--tag", default="0", help="names a fresh store (project, file, schema)")
    p.add_argument("--write-rows", type=int, default=100_000, help="rows per write call")
    p.add_argument("--read-rows", type=int, default=1_000, help="keys per read call")
    p.add_argument("--expect", choices=("values", "update"), default="values")
    args = p.parse_args()
    data = np.load(os.path.join(args.workdir, "rows.npz"))
    keys = data["keys"]
    store, _ = feature_store(args)
    if args.phase in ("load", "update"):
        values = data["values" if args.phase == "load" else "update"]
        ts = datetime.datetime.now(datetime.timezone.utc)
        parts = frames(keys, values, args.write_rows, ts)
        t, cpu = time.perf_counter(), time.process_time()
        for df in parts:
            store.write_to_online_store(VIEW, df)
        seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
    else:
        expected = data[args.expect]
        t, cpu = time.perf_counter(), time.process_time()
        got = []
        for lo in range(0, len(keys), args.read_rows):
            rows = {"item_id": keys[lo : lo + args.read_rows].tolist()}
            res = store.get_online_features(features=[f"{VIEW}:embedding"], entity_rows=rows)
            got.append(res.to_dict()["embedding"])
        seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
        flat = [v for part in got for v in part]
        if len(flat) != len(keys) or any(v is None for v in flat):
            raise SystemExit(f"feast read {sum(v is not None for v in flat)} of {len(keys)} keys")
        sample = np.random.default_rng(0).choice(len(keys), min(1000, len(keys)), replace=False)
        for i in sample:
            if not np.array_equal(np.asarray(flat[i], np.float32), expected[i]):
                raise SystemExit(f"feast read a different row for key {keys[i]}")
    print(json.dumps({"phase": args.phase, "rows": len(keys), "seconds": seconds, "cpu_s": cpu}))


if __name__ == "__main__":
    main()
