"""Training configs of the tiny model for tests that run :func:`deltarec.train.run_training`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deltarec.train import TrainConfig


def tiny_train_config(
    tmp: str, *, steps: int, batch_size: int, checkpoint_every: int, resume_step: int | None
) -> TrainConfig:
    """The tiny model trained for ``steps`` under ``{tmp}/work``, checkpointing every
    ``checkpoint_every`` steps and resuming from ``resume_step`` unless it is None; logs only
    rarely.

    The imports are inside so that collecting a test module does not import torch.
    """
    from deltarec.model import tiny_model_config
    from deltarec.train import TrainConfig

    return TrainConfig(
        model=tiny_model_config(),
        steps=steps,
        batch_size=batch_size,
        workdir=f"{tmp}/work",
        checkpoint_every=checkpoint_every,
        resume=resume_step is not None,
        resume_step=resume_step,
        log_every=1000,
    )
