"""Configuration of a training run (pydantic, unknown keys rejected)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deltarec.model.config import DataConfig, ModelConfig


class TrainConfig(BaseModel):
    """One training run of the example model (the same on every rank)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    model: ModelConfig = ModelConfig()
    """The example model: its tables, their dims and sharding, and the ZCH table
    (:class:`~deltarec.model.config.ModelConfig`)."""
    data: DataConfig = DataConfig()
    """The synthetic stream's length per rank."""
    steps: int = Field(default=300, ge=0)
    """Train until this global step (a resumed run continues up to it)."""
    batch_size: int = Field(default=128, ge=1)
    """Samples per rank per step (the same on every rank)."""
    seed: int = 0
    """Seeds the data stream and the dense layers' initialisation."""
    device: Literal["cpu", "cuda"] = "cpu"
    """``cpu`` (gloo) or ``cuda`` (nccl; rank ``r`` uses ``cuda:<local rank>``)."""
    workdir: str | None = None
    """Checkpoints go to ``<workdir>/checkpoints/step-<N>/``; None: no checkpoints."""
    checkpoint_every: int | None = Field(default=None, ge=1)
    """Save a checkpoint every this many steps (needs ``workdir``)."""
    checkpoint_at_end: bool = True
    """Save a checkpoint after the last step (when ``workdir`` is set)."""
    resume: bool = True
    """Resume from the newest complete checkpoint under ``workdir`` if there is one."""
    resume_step: int | None = Field(default=None, ge=0)
    """Resume from the checkpoint of exactly this step instead of the newest."""
    eval_every: int | None = Field(default=None, ge=1)
    """Evaluate every this many steps (no gradient, no optimizer step, no MCH admission)."""
    eval_batches: int = Field(default=4, ge=1)
    """Batches per evaluation, per rank."""
    export_tables: str | None = None
    """At the end, write every table in full as ``<export_tables>/<table id>.parquet``."""
    log_every: int = Field(default=50, ge=1)
    """Log loss and steps/s on rank 0 every this many steps."""

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.checkpoint_every is not None and self.workdir is None:
            raise ValueError("checkpoint_every needs workdir (where checkpoints are written)")
        if self.resume_step is not None and (self.workdir is None or not self.resume):
            raise ValueError("resume_step needs workdir and resume=True")
        return self
