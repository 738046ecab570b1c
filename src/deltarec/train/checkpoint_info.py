"""Which generation and step each training checkpoint is at, read without loading the model.

A restore from a checkpoint starts a new generation whose parent is the point (generation of
the run's dumper at save time, checkpoint step); retention (``deltarec gc``) keeps what such a
restore reads. :func:`read_checkpoints` lists the complete checkpoints under a trainer's
``--workdir`` with those facts:

* from the ``COMPLETE`` marker's ``lineage`` (``[{"run", "generation"}, ...]``, one entry per
  hook whose state names a run and a generation: the dumper's), written by rank 0 at save;
* for a checkpoint saved before the marker carried it, from rank 0's hook states in the DCP
  files (only that entry is read; ``torch.load`` with ``weights_only=True`` on the CPU).

Every dumper rank is in the same generation, so rank 0's state speaks for the run.
"""

from __future__ import annotations

import io
import json
import re
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltarec.train.errors import CheckpointError

COMPLETE = "COMPLETE"
"""The marker rank 0 writes last, after every rank's files are durable."""
STEP_RE = re.compile(r"^step-(\d+)$")
RANK0_HOOKS = "hooks.rank-00000"
"""Rank 0's packed hook states in a checkpoint's DCP metadata."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint: its step and the (run, generation) its dumpers were writing.

    ``lineage`` is empty for a checkpoint saved without a dumper or before it started (a restore
    from it starts a fresh lineage and reads nothing of the artifacts).
    """

    path: str
    step: int
    lineage: tuple[tuple[str, int], ...]


def lineage_of(states: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The ``{"run", "generation"}`` of every hook state (by hook key) that names both.

    The dumper's state (:meth:`deltarec.dump.dumper.DeltaDumper.state_dict`) does; a state
    whose generation is None (saved before the dumper started) names none.
    """
    out = []
    for _, state in sorted(states.items()):
        if isinstance(state, Mapping) and state.get("run") and state.get("generation") is not None:
            out.append({"run": str(state["run"]), "generation": int(state["generation"])})
    return out


def complete_marker(step: int, world_size: int, hook_states: Mapping[str, Any]) -> dict[str, Any]:
    """The ``COMPLETE`` marker of a checkpoint: step, world size, time and rank 0's lineage."""
    return {
        "step": step,
        "world_size": world_size,
        "time": time.time(),
        "lineage": lineage_of(hook_states),
    }


def read_checkpoints(workdir: str) -> list[CheckpointInfo]:
    """Every complete checkpoint under ``<workdir>/checkpoints``, by step.

    A directory without ``COMPLETE`` is ignored (a restore ignores it too). A workdir without a
    ``checkpoints`` folder has none.

    Raises:
        CheckpointError: ``workdir`` is not a readable directory, or a complete checkpoint's
            marker or hook states cannot be read.
    """
    top = Path(workdir)
    if "://" in workdir:
        raise CheckpointError(workdir, "checkpoints are read from a local or mounted path")
    if not top.is_dir():
        raise CheckpointError(workdir, "not a readable directory (the trainer's --workdir)")
    root = top / "checkpoints"
    try:
        children = sorted(root.iterdir()) if root.exists() else []
    except OSError as e:
        raise CheckpointError(str(root), f"cannot be listed: {e}") from e
    out = []
    for child in children:
        m = STEP_RE.match(child.name)
        if m is None or not (child / COMPLETE).is_file():
            continue
        out.append(_read_one(child, int(m.group(1))))
    return sorted(out, key=lambda c: c.step)


def _read_one(path: Path, step: int) -> CheckpointInfo:
    try:
        meta = json.loads((path / COMPLETE).read_text())
        if int(meta["step"]) != step:
            raise ValueError(f"its marker says step {meta['step']}")
        lineage = meta["lineage"] if "lineage" in meta else lineage_of(_rank0_hook_states(path))
        pairs = tuple((str(e["run"]), int(e["generation"])) for e in lineage)
    except CheckpointError:
        raise
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(str(path), f"its generation cannot be read: {first}") from e
    return CheckpointInfo(str(path), step, pairs)


def _rank0_hook_states(path: Path) -> dict[str, Any]:
    """Rank 0's hook states from the DCP files (checkpoints whose marker lacks ``lineage``)."""
    import torch
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    if RANK0_HOOKS not in md:
        return {}  # saved by a trainer without hooks
    size = md[RANK0_HOOKS].size  # type: ignore[union-attr]
    state = {"hooks": {"rank-00000": torch.empty(size, dtype=torch.uint8)}}
    with warnings.catch_warnings():  # one process reading on purpose (no_dist), not a mistake
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    blob = state["hooks"]["rank-00000"].numpy().tobytes()
    # weights_only: a checkpoint is data, never code (a pickle could run anything)
    saved = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    return dict(saved)
