"""Training checkpoints with torch.distributed.checkpoint (DCP).

Layout: ``<workdir>/checkpoints/step-<N:08d>/`` holds the DCP files, then ``COMPLETE``
(JSON: step, world size, time, and ``lineage``: the run and generation rank 0's dumper was
writing, read by ``deltarec gc`` through :mod:`deltarec.train.checkpoint_info`), written by
rank 0 last, after every rank's files are durable. A directory without ``COMPLETE`` is
ignored and overwritten when that step is saved again.

The DCP state:

* ``model``: ``dmp.state_dict()``: every table shard (ShardedTensor), the MCH buffers
  (``_mch_sorted_raw_ids``, ``_mch_remapped_ids_mapping``, eviction metadata, iteration),
  the dense layers and the data-parallel tables;
* ``optim``: the combined optimizer's state (fused row-wise momenta as ShardedTensors, dense
  Adagrad sums);
* ``progress``: ``step``, ``world_size``, ``seed``, ``data_position`` (batches consumed per
  rank; batch ``i`` is a pure function of seed, rank and ``i``), as 0-d int64 tensors;
* ``hooks``: ``{"rank-<R:05d>": uint8 tensor}`` - rank R's ``{hook key: hook.state_dict()}``,
  serialized with ``torch.save``. Each rank keeps its own hook state (a dumper's state may
  differ per rank), so a checkpoint restores only at the world size it was saved with.

Everything is a tensor on purpose: DCP falls back to its pre-2.4 key flattening when a rank
lacks a key the checkpoint has (a table-wise table on another rank), and that flattening
differs from the current one only for dicts without tensors.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from deltarec.faults import failpoint
from deltarec.model.sharding import ShardedModel
from deltarec.train.checkpoint_info import COMPLETE, STEP_RE, complete_marker
from deltarec.train.errors import CheckpointError
from deltarec.train.hooks import TrainHook

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Progress:
    """Where a run is: the global step and what the data stream consumed."""

    step: int
    world_size: int
    seed: int
    data_position: int


def hook_key(hook: TrainHook, index: int) -> str:
    """Key of a hook's state in a checkpoint: its class and its position among the hooks."""
    cls = type(hook)
    return f"{cls.__module__}.{cls.__qualname__}#{index}"


class CheckpointManager:
    """Save and find checkpoints under ``<workdir>/checkpoints`` (a local or shared path).

    Every method that takes a model is a collective: call it on every rank.
    """

    def __init__(self, workdir: str) -> None:
        self.root = Path(workdir) / "checkpoints"

    def path(self, step: int) -> Path:
        """Directory of the checkpoint of ``step``."""
        return self.root / f"step-{step:08d}"

    def complete_steps(self) -> list[int]:
        """Steps of every complete checkpoint, ascending (reads the file system)."""
        if not self.root.is_dir():
            return []
        steps = []
        for child in self.root.iterdir():
            m = STEP_RE.match(child.name)
            if m and (child / COMPLETE).is_file():
                steps.append(int(m.group(1)))
        return sorted(steps)

    def choose(self, step: int | None) -> int | None:
        """The step to resume from, decided on rank 0 and shared with every rank.

        Args:
            step: a wanted step, or None for the newest complete checkpoint.

        Raises:
            CheckpointError: if ``step`` is given and has no complete checkpoint.
        """
        chosen: list[Any] = [None]
        if dist.get_rank() == 0:
            steps = self.complete_steps()
            if step is None:
                chosen[0] = steps[-1] if steps else None
            else:
                chosen[0] = step if step in steps else f"missing:{steps}"
        dist.broadcast_object_list(chosen, src=0)
        if isinstance(chosen[0], str):
            raise CheckpointError(
                str(self.path(step or 0)),
                f"no complete checkpoint of step {step}; complete: {chosen[0][8:]}",
            )
        return chosen[0]

    def save(self, model: ShardedModel, progress: Progress, hooks: Sequence[TrainHook]) -> Path:
        """Save model, optimizer, progress and hook states for ``progress.step``; collective."""
        path = self.path(progress.step)
        if dist.get_rank() == 0 and path.exists():
            shutil.rmtree(path)
        dist.barrier()
        hook_states = {hook_key(h, i): h.state_dict() for i, h in enumerate(hooks)}
        state = {
            "model": model.dmp.state_dict(),
            "optim": model.optimizer.state_dict(),
            "progress": {k: torch.tensor(v) for k, v in progress.__dict__.items()},
            "hooks": {_rank_key(): _pack_hooks(hook_states)},
        }
        try:
            dcp.save(state, checkpoint_id=str(path))
        except Exception as e:
            raise CheckpointError(str(path), f"save failed: {e}") from e
        failpoint("checkpoint.save")
        dist.barrier()
        if dist.get_rank() == 0:
            marker = complete_marker(progress.step, progress.world_size, hook_states)
            _write_atomic(path / COMPLETE, json.dumps(marker))
        dist.barrier()
        return path

    def load(self, step: int, model: ShardedModel, hooks: Sequence[TrainHook]) -> Progress:
        """Restore model, optimizer and hook states from the checkpoint of ``step``; collective.

        Raises:
            CheckpointError: if the checkpoint is unreadable or from another world size.
        """
        path = self.path(step)
        try:
            meta = json.loads((path / COMPLETE).read_text())
            if meta["world_size"] != dist.get_world_size():
                raise CheckpointError(
                    str(path),
                    f"saved by {meta['world_size']} ranks, cannot restore on "
                    f"{dist.get_world_size()} ranks",
                )
            md = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
            blob = md[f"hooks.{_rank_key()}"]
            state: dict[str, Any] = {
                "model": model.dmp.state_dict(),
                "optim": model.optimizer.state_dict(),
                "progress": {f: torch.tensor(0) for f in Progress.__dataclass_fields__},
                "hooks": {_rank_key(): torch.empty(blob.size, dtype=torch.uint8)},  # type: ignore[union-attr]
            }
            dcp.load(state, checkpoint_id=str(path))
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(str(path), f"load failed: {e}") from e
        model.dmp.load_state_dict(state["model"])
        model.optimizer.load_state_dict(state["optim"])
        _unpack_hooks(state["hooks"][_rank_key()], hooks, str(path))
        return Progress(**{k: int(v) for k, v in state["progress"].items()})


def _rank_key(rank: int | None = None) -> str:
    return f"rank-{dist.get_rank() if rank is None else rank:05d}"


def _pack_hooks(hook_states: dict[str, Any]) -> torch.Tensor:
    """Every hook's state (by hook key), ``torch.save``-d into a uint8 tensor (a DCP entry)."""
    buf = io.BytesIO()
    torch.save(hook_states, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _unpack_hooks(blob: torch.Tensor, hooks: Sequence[TrainHook], path: str) -> None:
    data = io.BytesIO(blob.numpy().tobytes())
    try:  # weights_only: a checkpoint is data, never code (a pickle could run anything)
        saved: dict[str, Any] = torch.load(data, map_location="cpu", weights_only=True)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(path, f"the hooks' state is not plain data: {first}") from e
    for i, h in enumerate(hooks):
        key = hook_key(h, i)
        if key in saved:
            h.load_state_dict(saved.pop(key))
        else:
            log.warning("checkpoint %s has no state for hook %s; it starts fresh", path, key)
    for key in saved:
        log.warning("checkpoint %s holds state of hook %s, which this run lacks", path, key)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
