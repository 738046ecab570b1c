"""The training loop of the example model: ``run_training(config, hooks) -> TrainResult``.

Call it on every rank inside an initialized default process group (``deltarec train`` does
that under torchrun; tests do it through :mod:`deltarec.testing.multiprocess`). Per step:

1. data agreement: every rank knows every rank's stream length from the (identical) config,
   so without any collective each rank sees which ranks still have a batch; if some do and
   some don't, every rank raises :class:`~deltarec.train.errors.DataExhaustedError`; if none
   do, training ends normally;
2. forward, backward (the fused optimizer updates embedding rows here), dense optimizer step;
3. ``hook.after_step(step)`` for every hook (steps count from 1);
4. every ``eval_every`` steps an evaluation (hooks' ``before_eval``/``after_eval`` around it),
   every ``checkpoint_every`` steps a checkpoint (including every hook's ``state_dict``),
   preceded by every hook's ``before_checkpoint()``, which may raise to veto it (the
   dump hook does when a newer trainer owns the run).

At the end: a checkpoint (``checkpoint_at_end``), ``hook.on_end(step)``, then the table
export (``export_tables``). ``hook.close()`` runs on every exit path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from deltarec.model.config import DataConfig
from deltarec.model.data import EVAL_STREAM, TRAIN_STREAM, ClickStream
from deltarec.model.sharding import ShardedModel, build_sharded_model
from deltarec.train.checkpoint import CheckpointManager, Progress
from deltarec.train.config import TrainConfig
from deltarec.train.errors import DataExhaustedError, TrainError
from deltarec.train.export import export_tables
from deltarec.train.hooks import TrainHook

log = logging.getLogger("deltarec.train")


@dataclass
class TrainResult:
    """What a run did (the same on every rank except ``exported``).

    Attributes:
        step: the last completed global step.
        start_step: the step training started from (the restored checkpoint's, or 0).
        restored_from: the checkpoint step restored, or None for a fresh start.
        data_exhausted: True if every rank ran out of data together before ``steps``.
        last_loss: the last training step's loss on this rank (None if no step ran).
        eval_losses: ``[(step, mean loss over ranks)]`` of every evaluation.
        checkpoints: steps of the checkpoints saved by this run.
        seconds: wall time of the training steps (excluding setup and export).
        exported: ``{table id: rows}`` written by the export (rank 0; ``{}`` elsewhere).
    """

    step: int
    start_step: int
    restored_from: int | None
    data_exhausted: bool = False
    last_loss: float | None = None
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)
    seconds: float = 0.0
    exported: dict[str, int] = field(default_factory=dict)

    @property
    def steps_per_s(self) -> float:
        """Training steps per second of this run."""
        n = self.step - self.start_step
        return n / self.seconds if self.seconds > 0 else 0.0


def device_for(config: TrainConfig) -> torch.device:
    """This rank's device: ``cpu``, or ``cuda:<LOCAL_RANK>``."""
    if config.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise TrainError("--device cuda was asked for, but torch sees no CUDA device")
    return torch.device("cuda", torch.cuda.current_device())


def run_training(
    config: TrainConfig,
    hooks: Sequence[TrainHook] = (),
    model: ShardedModel | None = None,
) -> TrainResult:
    """Train the example model on this rank; call on every rank of the default process group.

    Args:
        config: the run's configuration (identical on every rank).
        hooks: training hooks, called in order (see :class:`~deltarec.train.hooks.TrainHook`).
        model: an already built model (default: :func:`build_sharded_model` from ``config``).

    Returns:
        The :class:`TrainResult`.

    Raises:
        DataExhaustedError: on every rank, if ranks ran out of data at different steps.
        CheckpointError: if a checkpoint cannot be saved or restored.
    """
    if not dist.is_initialized():
        raise TrainError("run_training needs an initialized default process group")
    try:
        sm = model or build_sharded_model(
            config.model, device_for(config), seed=config.seed, max_batch_size=config.batch_size
        )
        ckpt = CheckpointManager(config.workdir) if config.workdir else None
        result = _restore(config, sm, ckpt, hooks)
        for h in hooks:
            h.on_start(sm.dmp, result.start_step, result.restored_from)
        _train(config, sm, ckpt, hooks, result)
        saved = result.step in result.checkpoints or result.step == result.restored_from
        if ckpt and config.checkpoint_at_end and not saved:
            _save(ckpt, sm, config, hooks, result)
        for h in hooks:
            h.on_end(result.step)
        if config.export_tables:
            result.exported = export_tables(sm, config.export_tables)
        return result
    finally:
        for h in hooks:
            h.close()


def _restore(
    config: TrainConfig,
    sm: ShardedModel,
    ckpt: CheckpointManager | None,
    hooks: Sequence[TrainHook],
) -> TrainResult:
    if ckpt is None or not config.resume:
        return TrainResult(step=0, start_step=0, restored_from=None)
    step = ckpt.choose(config.resume_step)
    if step is None:
        return TrainResult(step=0, start_step=0, restored_from=None)
    progress = ckpt.load(step, sm, hooks)
    if progress.seed != config.seed:
        log.warning(
            "checkpoint step %d was trained with seed %d, now %d", step, progress.seed, config.seed
        )
    if dist.get_rank() == 0:
        log.info("resumed from checkpoint step %d (%s)", step, ckpt.path(step))
    return TrainResult(step=progress.step, start_step=progress.step, restored_from=step)


def _agree_on_data(data: DataConfig, index: int, step: int) -> bool:
    """True if every rank has batch ``index``, False if none has; else raise on every rank.

    Every rank evaluates the same lengths from the same config, so all ranks decide alike
    without a collective on the per-step path.
    """
    world = dist.get_world_size()
    lengths = [data.length_for(r) for r in range(world)]
    have = [n is None or index < n for n in lengths]
    if all(have):
        return True
    if not any(have):
        return False
    raise DataExhaustedError(step, [r for r, h in enumerate(have) if not h], world)


def _train(
    config: TrainConfig,
    sm: ShardedModel,
    ckpt: CheckpointManager | None,
    hooks: Sequence[TrainHook],
    result: TrainResult,
) -> None:
    rank = dist.get_rank()
    stream = ClickStream(config.model, config.data, config.batch_size, config.seed, rank)
    evals = ClickStream(
        config.model, config.data, config.batch_size, config.seed, rank, EVAL_STREAM
    )
    assert stream.stream == TRAIN_STREAM
    sm.dmp.train()
    t0 = time.perf_counter()
    window_t, window_step = t0, result.step
    loss: torch.Tensor | None = None
    while result.step < config.steps:
        if not _agree_on_data(config.data, result.step, result.step + 1):
            result.data_exhausted = True
            if rank == 0:
                log.info("every rank ran out of data after step %d; stopping", result.step)
            break
        batch = stream.batch(result.step).to(sm.device)
        sm.optimizer.zero_grad()
        loss, _ = sm.dmp(*batch.model_inputs())
        loss.backward()
        sm.optimizer.step()
        result.step += 1
        for h in hooks:
            h.after_step(result.step)
        if result.step % config.log_every == 0 or result.step == config.steps:
            result.last_loss = float(loss.detach())
            now = time.perf_counter()
            if rank == 0:
                rate = (result.step - window_step) / max(now - window_t, 1e-9)
                log.info(
                    "step %d/%d  loss %.4f  %.1f steps/s",
                    result.step,
                    config.steps,
                    result.last_loss,
                    rate,
                )
            window_t, window_step = now, result.step
        if config.eval_every and result.step % config.eval_every == 0:
            result.eval_losses.append(
                (result.step, _evaluate(sm, evals, config, hooks, result.step))
            )
        if ckpt and config.checkpoint_every and result.step % config.checkpoint_every == 0:
            _save(ckpt, sm, config, hooks, result)
    result.seconds = time.perf_counter() - t0
    if loss is not None:
        result.last_loss = float(loss.detach())


def _evaluate(
    sm: ShardedModel,
    evals: ClickStream,
    config: TrainConfig,
    hooks: Sequence[TrainHook],
    step: int,
) -> float:
    """Mean eval loss over ranks: no gradient, no optimizer, MC modules in eval (no admission)."""
    for h in hooks:
        h.before_eval()
    sm.dmp.eval()
    total = torch.zeros(2, dtype=torch.float64, device=sm.device)
    try:
        with torch.no_grad():
            first = (step // (config.eval_every or 1)) * config.eval_batches
            for i in range(config.eval_batches):
                batch = evals.batch(first + i, at_step=step).to(sm.device)
                loss, _ = sm.dmp(*batch.model_inputs())
                total[0] += loss.double()
                total[1] += 1
    finally:
        sm.dmp.train()
        for h in hooks:
            h.after_eval()
    dist.all_reduce(total)
    mean = float(total[0] / total[1])
    if dist.get_rank() == 0:
        log.info("eval at step %d: loss %.4f", step, mean)
    return mean


def _save(
    ckpt: CheckpointManager,
    sm: ShardedModel,
    config: TrainConfig,
    hooks: Sequence[TrainHook],
    result: TrainResult,
) -> None:
    for h in hooks:  # a hook may veto the checkpoint (a superseded trainer writes none)
        h.before_checkpoint()
    progress = Progress(
        step=result.step,
        world_size=dist.get_world_size(),
        seed=config.seed,
        data_position=result.step,
    )
    path = ckpt.save(sm, progress, hooks)
    result.checkpoints.append(result.step)
    if dist.get_rank() == 0:
        log.info("checkpoint step %d saved to %s", result.step, path)
