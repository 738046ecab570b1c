"""The replica's own record of where it is, so a restart resumes without re-reading the outbox.

A state directory holds ``replica.json`` and one data folder it names::

    <state_dir>/replica.json                 # written last, atomically (rename)
    <state_dir>/data-<version:016x>/<table>.keys.npy, .versions.npy, .rows.npy
    <state_dir>/data-<version:016x>/dense.bin   # the dense state's bytes, if any

``replica.json``::

    {"schema_version": 1, "run": "demo", "generation": 3, "seq": 12, "version": ...,
     "digest": "<sha256 of the last applied MANIFEST.json>", "data": "data-...",
     "pointer": {"generation": 3, "seq": 10, "promoted_at": ...},
     "dense": {"path": ..., "sha256": ..., "bytes": ..., "step": ..., "format": "torch",
               "generation": 3, "seq": 12},
     "tables": {"sparse.ebc.user_id": {"dim": 64, "dtype": "float32", "kind": "plain", ...}},
     "saved_at": "..."}

The data folder is complete before ``replica.json`` names it, so a replica killed at any
moment restarts from the last state it recorded; the outbox then gives the dumps after it.
Older data folders are removed after the record moves on.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deltarec.artifacts.dense import DenseInfo
from deltarec.artifacts.types import TableSpec, utc_now
from deltarec.errors import ArtifactError
from deltarec.ids import SCHEMA_VERSION
from deltarec.serving.replica import DenseState, Line
from deltarec.serving.table import TableWriter
from deltarec.serving.types import Position

STATE_FILE = "replica.json"


@dataclass(frozen=True)
class SavedState:
    """What ``replica.json`` says (without the rows)."""

    position: Position
    digest: str
    data: str
    pointer: dict[str, Any] | None
    tables: dict[str, TableSpec]
    dense: dict[str, Any] | None


def read_state(state_dir: str, run: str) -> SavedState | None:
    """The recorded state of ``state_dir`` (None if none yet).

    Raises:
        ArtifactError: the record is malformed or belongs to another run.
    """
    path = os.path.join(state_dir, STATE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as e:
        raise ArtifactError(path, f"unreadable replica state: {e}") from e
    if obj.get("schema_version") != SCHEMA_VERSION:
        raise ArtifactError(path, f"unknown schema_version {obj.get('schema_version')!r}")
    if obj.get("run") != run:
        raise ArtifactError(path, f"records run {obj.get('run')!r}, this replica serves {run!r}")
    try:
        return SavedState(
            position=Position(run, int(obj["generation"]), int(obj["seq"])),
            digest=str(obj.get("digest", "")),
            data=str(obj["data"]),
            pointer=obj.get("pointer"),
            tables={t: TableSpec.from_json(v, f"{path}: {t}") for t, v in obj["tables"].items()},
            dense=obj.get("dense"),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ArtifactError(path, f"malformed replica state: {e}") from e


def save_state(state_dir: str, line: Line, pointer: dict[str, Any] | None) -> str:
    """Record ``line``'s point and rows in ``state_dir``; returns the record's path.

    Rows are written to a fresh data folder first, then ``replica.json`` is replaced.
    """
    os.makedirs(state_dir, exist_ok=True)
    p = line.position
    data = f"data-{p.version:016x}"
    tmp = os.path.join(state_dir, f".tmp-{data}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    tables = {}
    for table, writer in line.writers.items():
        s = writer.state
        rows = s.storage.index_select(0, s.slots.to(s.storage.device)).cpu().numpy()
        np.save(os.path.join(tmp, f"{table}.keys.npy"), s.keys_np)
        np.save(os.path.join(tmp, f"{table}.versions.npy"), s.versions_np)
        np.save(os.path.join(tmp, f"{table}.rows.npy"), rows)
        tables[table] = s.spec.to_json()
    dense = None
    if line.dense is not None:
        buf = io.BytesIO()
        torch.save({k: v.cpu() for k, v in line.dense.tensors.items()}, buf)
        _write(os.path.join(tmp, "dense.bin"), buf.getvalue())
        d = line.dense
        dense = {**d.info.to_json(), "generation": d.generation, "seq": d.seq}
    final = os.path.join(state_dir, data)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    record = {
        "schema_version": SCHEMA_VERSION,
        "run": p.run,
        "generation": p.generation,
        "seq": p.seq,
        "version": p.version,
        "digest": line.digest,
        "data": data,
        "pointer": pointer,
        "dense": dense,
        "tables": tables,
        "saved_at": utc_now(),
    }
    path = os.path.join(state_dir, STATE_FILE)
    _write(path, json.dumps(record, indent=2).encode())
    for name in os.listdir(state_dir):
        if name.startswith("data-") and name != data:
            shutil.rmtree(os.path.join(state_dir, name), ignore_errors=True)
    return path


def load_line(state_dir: str, saved: SavedState, root: Any, device: torch.device) -> Line:
    """The line ``saved`` recorded, rebuilt from its data folder.

    Raises:
        ArtifactError: the data folder is missing or incomplete.
    """
    folder = os.path.join(state_dir, saved.data)
    writers = {}
    try:
        for table, spec in saved.tables.items():
            keys = np.load(os.path.join(folder, f"{table}.keys.npy"))
            versions = np.load(os.path.join(folder, f"{table}.versions.npy"))
            rows = np.load(os.path.join(folder, f"{table}.rows.npy"))
            writers[table] = TableWriter.from_rows(table, spec, device, keys, rows, versions)
        dense = None
        if saved.dense is not None:
            with open(os.path.join(folder, "dense.bin"), "rb") as f:
                tensors = torch.load(f, map_location=device, weights_only=True)
            info = DenseInfo.from_json(saved.dense, os.path.join(state_dir, STATE_FILE))
            gen, seq = int(saved.dense["generation"]), int(saved.dense["seq"])
            dense = DenseState(info, gen, seq, dict(tensors))
    except (OSError, ValueError) as e:
        raise ArtifactError(folder, f"replica state data unreadable: {e}") from e
    return Line(root, saved.position, writers, dense, saved.digest, device)


def _write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


__all__ = ["STATE_FILE", "SavedState", "load_line", "read_state", "save_state"]
